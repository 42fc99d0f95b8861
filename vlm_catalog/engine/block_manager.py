"""Paged KV-cache block allocation with reference counts and prefix caching.

The KV pool is `num_blocks` fixed-size blocks. Every request owns a block table
(block ids, in token order). With prefix caching on, a block that is full of
computed tokens is registered under a content hash (`block_hash.py`); a later
request whose prompt starts with the same blocks reuses them (reference count
+1) instead of recomputing them.

All blocks with reference count 0 sit in one queue, ordered for eviction: never
used or long unused first. Cached blocks stay cached while in the queue, until
a new allocation takes them from the head (evicting their hash). A request's
blocks are returned to the tail last-block-first, so a freed sequence's tail
(least likely shared) is evicted before its head.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # content hash -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict((block, None) for block in range(num_blocks))
        self.tables: dict[Hashable, list[int]] = {}
        self.num_hashed: dict[Hashable, int] = {}  # leading blocks of a table already registered
        self.stats = {"hit_blocks": 0, "queried_blocks": 0, "evicted_blocks": 0}

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now (free or cached-but-unused)."""
        return len(self.free_queue)

    def block_table(self, request_id: Hashable) -> list[int]:
        return self.tables.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest run of `hashes` present in the cache (changes nothing)."""
        if not self.enable_prefix_caching:
            return []
        blocks: list[int] = []
        for block_hash in hashes:
            block = self.cached.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    # --------------------------------------------------------------- mutations
    def allocate(self, request_id: Hashable, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Grow the request's table to hold `num_tokens` tokens; False (and no change) if the pool is short.

        `cached_blocks` (only for a request with no table yet) are prefix-cache
        hits to share instead of allocating.
        """
        table = self.tables.get(request_id)
        if cached_blocks and table:
            raise ValueError("cached blocks can only start a new block table")
        current = len(table) if table else 0
        reusable = len(cached_blocks)
        new_needed = max(0, self.blocks_needed(num_tokens) - current - reusable)
        free_after_touch = len(self.free_queue) - sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        if new_needed > free_after_touch:
            return False
        table = self.tables.setdefault(request_id, [])
        for block in cached_blocks:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1
            table.append(block)
        if cached_blocks:
            self.num_hashed[request_id] = len(cached_blocks)
        for _ in range(new_needed):
            table.append(self._take_free_block())
        return True

    def free(self, request_id: Hashable) -> None:
        """Release a request's blocks (finished, aborted or preempted)."""
        table = self.tables.pop(request_id, [])
        self.num_hashed.pop(request_id, None)
        for block in reversed(table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None

    def cache_full_blocks(self, request_id: Hashable, hashes: Sequence[bytes], num_computed_tokens: int) -> None:
        """Register the request's blocks that are now full of computed tokens under their hashes."""
        if not self.enable_prefix_caching:
            return
        table = self.tables.get(request_id, [])
        full = min(num_computed_tokens // self.block_size, len(hashes), len(table))
        for index in range(self.num_hashed.get(request_id, 0), full):
            block, block_hash = table[index], hashes[index]
            if self.block_hash[block] is None and block_hash not in self.cached:
                self.block_hash[block] = block_hash
                self.cached[block_hash] = block
        self.num_hashed[request_id] = max(self.num_hashed.get(request_id, 0), full)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents)."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks

    def reset_stats(self) -> None:
        self.stats = dict.fromkeys(self.stats, 0)

    def record_lookup(self, queried: int, hits: int) -> None:
        self.stats["queried_blocks"] += queried
        self.stats["hit_blocks"] += hits

    def _take_free_block(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        evicted = self.block_hash[block]
        if evicted is not None:
            del self.cached[evicted]
            self.block_hash[block] = None
            self.stats["evicted_blocks"] += 1
        self.ref_counts[block] = 1
        return block
