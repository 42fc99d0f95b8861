"""The size-bounded LRU behind the encoder cache (and the vision tower's grid tables), and the
embeddings the engine puts there: each image's own rows, so that its bound in tokens bounds bytes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.engine.conftest import conversation
from vlm_catalog.engine.encoder_cache import EncoderCache
from vlm_catalog.engine.llm_engine import LLMEngine
from vlm_catalog.engine.sampling_params import SamplingParams
from vlm_catalog.sized_lru import SizedLRU


@dataclass
class Embedding:
    num_tokens: int


def test_least_recently_used_go_first_when_the_tokens_pass_the_bound():
    cache = EncoderCache(max_tokens=100)
    cache.put("a", Embedding(40))
    cache.put("b", Embedding(40))
    assert cache.get("a") is not None  # "b" is now the least recently used
    cache.put("c", Embedding(40))
    assert "b" not in cache and "a" in cache and "c" in cache
    assert cache.size == 80 and (cache.hits, cache.misses) == (1, 0)
    assert cache.get("b") is None and cache.misses == 1


def test_an_image_larger_than_the_cache_stays_alone_for_its_later_chunks():
    cache = EncoderCache(max_tokens=100)
    cache.put("a", Embedding(40))
    cache.put("huge", Embedding(150))
    assert "huge" in cache and len(cache) == 1 and cache.size == 150


def test_putting_a_known_key_refreshes_it_without_counting_it_twice():
    cache = SizedLRU(10, size_of=len)
    cache.put("x", "abcd")
    cache.put("y", "efgh")
    cache.put("x", "abcd")  # "y" is now the least recently used
    assert cache.size == 8
    cache.put("z", "ijkl")
    assert "y" not in cache and "x" in cache and cache.size == 8
    cache.clear()
    assert len(cache) == 0 and cache.size == 0


def owns_its_rows(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def test_images_encoded_together_are_cached_as_their_own_rows(engine_checkpoint):
    """Two images encoded in one step come out as views of one output; cached as such, one image
    kept would hold both images' rows (and all four tensors of them) while the cache counts one
    image's tokens. The engine caches copies of each image's rows (`ImageEmbedding.owning`), with
    the same values."""
    engine = LLMEngine(model=engine_checkpoint, max_num_batched_tokens=2048)
    try:
        engine.add_request(conversation(0, images=2), SamplingParams(max_tokens=2, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        cache = engine.encoder_cache
        assert engine.runner.num_images_encoded == 2 and len(cache) == 2
        for embedding in cache.values():
            assert all(owns_its_rows(t) for t in (embedding.embeddings, *embedding.deepstack))
            assert embedding.owning() is embedding  # nothing to copy any more
    finally:
        engine.close()


def test_owning_copies_views_and_keeps_what_owns_its_rows():
    from vlm_catalog.model.qwen3_vl_moe import ImageEmbedding

    batch = [torch.randn(10, 4) for _ in range(3)]  # an embedding and two deepstack rows of two images
    first = ImageEmbedding(batch[0][:6], [d[:6] for d in batch[1:]])
    owned = first.owning()
    assert owned is not first and all(owns_its_rows(t) for t in (owned.embeddings, *owned.deepstack))
    assert torch.equal(owned.embeddings, batch[0][:6]) and all(
        torch.equal(got, want[:6]) for got, want in zip(owned.deepstack, batch[1:]))
    alone = ImageEmbedding(batch[0], batch[1:])
    assert alone.owning() is alone
