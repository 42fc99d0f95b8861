"""Block manager: exact block ids, reference counts, prefix hits and eviction order."""

import random

from vlm_catalog.engine.block_hash import block_hashes
from vlm_catalog.engine.block_manager import BlockManager


def test_allocation_sharing_and_eviction_order():
    manager = BlockManager(num_blocks=6, block_size=4)
    assert manager.allocate("a", 10) and manager.block_table("a") == [0, 1, 2]
    assert manager.allocate("b", 5) and manager.block_table("b") == [3, 4]
    assert not manager.allocate("c", 8)  # needs 2 blocks, 1 free: refused without change
    assert manager.block_table("c") == [] and manager.num_free_blocks == 1

    hashes_a = block_hashes(list(range(10)), 4)
    assert len(hashes_a) == 2  # only full blocks are hashed
    manager.cache_full_blocks("a", hashes_a, num_computed_tokens=10)
    manager.free("a")
    assert list(manager.free_queue) == [5, 2, 1, 0]  # freed tail-first behind the never-used block
    assert manager.ref_counts[:3] == [0, 0, 0]

    hits = manager.cached_prefix(hashes_a + block_hashes(list(range(12)), 4)[2:])
    assert hits == [0, 1]
    assert manager.allocate("d", 9, cached_blocks=hits)
    assert manager.block_table("d") == [0, 1, 5]  # two shared blocks + one from the head of the queue
    assert list(manager.free_queue) == [2]
    assert manager.allocate("e", 4) and manager.block_table("e") == [2]
    assert manager.stats["evicted_blocks"] == 0

    assert manager.allocate("sharer", 8, cached_blocks=[0, 1])
    assert manager.ref_counts[0] == manager.ref_counts[1] == 2  # d and sharer
    manager.free("sharer")
    manager.free("d")
    assert manager.ref_counts[0] == 0 and list(manager.free_queue) == [5, 1, 0]

    assert manager.allocate("f", 4) and manager.block_table("f") == [5]  # uncached: nothing evicted
    assert manager.allocate("g", 4) and manager.block_table("g") == [1]  # takes cached block 1: evicts it
    assert manager.stats["evicted_blocks"] == 1
    assert manager.cached_prefix(hashes_a) == [0]  # block 0 still cached, block 1 gone


def test_growing_a_table_block_by_block():
    manager = BlockManager(num_blocks=4, block_size=2)
    assert manager.allocate("r", 1) and manager.block_table("r") == [0]
    assert manager.allocate("r", 2) and manager.block_table("r") == [0]  # still fits
    assert manager.allocate("r", 3) and manager.block_table("r") == [0, 1]
    assert not manager.allocate("r", 9)  # 5 blocks > pool
    assert manager.block_table("r") == [0, 1]


def test_prefix_caching_off_never_hits():
    manager = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    hashes = block_hashes([1, 2, 3, 4], 2)
    manager.allocate("a", 4)
    manager.cache_full_blocks("a", hashes, 4)
    manager.free("a")
    assert manager.cached_prefix(hashes) == [] and manager.cached == {}


def test_hash_chain_and_images():
    tokens = [5, 6, 7, 9, 9, 9, 9, 8]
    plain = block_hashes(tokens, 4)
    same = block_hashes(list(tokens), 4)
    assert plain == same and len(plain) == 2
    other_first = block_hashes([0] + tokens[1:], 4)
    assert other_first[0] != plain[0] and other_first[1] != plain[1]  # the chain carries the change
    # tokens 3..6 are an image's placeholders: different pictures, different hashes
    cat = block_hashes(tokens, 4, [(3, 4)], ["cat"])
    dog = block_hashes(tokens, 4, [(3, 4)], ["dog"])
    assert cat[0] != dog[0] and cat != plain
    # incremental hashing from a later block equals hashing everything at once
    assert block_hashes(tokens, 4, [(3, 4)], ["cat"], start_block=1, previous=cat[0]) == cat[1:]


def test_no_leaks_after_many_random_requests():
    rng = random.Random(0)
    manager = BlockManager(num_blocks=64, block_size=4)
    live: dict[int, list[int]] = {}
    for request in range(3000):
        if live and rng.random() < 0.5:
            victim = rng.choice(list(live))
            tokens = live.pop(victim)
            manager.cache_full_blocks(victim, block_hashes(tokens, 4), len(tokens))
            manager.free(victim)
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 24))]
        hits = manager.cached_prefix(block_hashes(tokens, 4)[: (len(tokens) - 1) // 4])
        if manager.allocate(request, len(tokens), hits):
            live[request] = tokens
    for request in list(live):
        manager.free(request)
    assert manager.num_free_blocks == 64 and set(manager.ref_counts) == {0}
    assert len(manager.cached) == sum(h is not None for h in manager.block_hash)
