"""The size-bounded LRU behind the encoder cache (and the vision tower's grid tables)."""

from __future__ import annotations

from dataclasses import dataclass

from vlm_catalog.engine.encoder_cache import EncoderCache
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
