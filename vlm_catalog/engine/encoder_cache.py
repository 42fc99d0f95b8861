"""Image embeddings by content hash, least recently used first out, bounded by tokens.

An image is encoded once and reused by every prefill chunk that covers part of
it, by a request recomputing after preemption, and by other requests showing
the same picture. Entries are evicted when the total would pass `max_tokens`;
the model runner holds its own references for the step in progress, so an
eviction never pulls features from under a running step.
"""

from __future__ import annotations

from vlm_catalog.model.qwen3_vl_moe import ImageEmbedding
from vlm_catalog.sized_lru import SizedLRU


class EncoderCache(SizedLRU[ImageEmbedding]):
    """`SizedLRU` of image embeddings by content hash, bounded in tokens; the newest entry
    always stays, so an image larger than the cache still serves all its prefill chunks."""

    def __init__(self, max_tokens: int) -> None:
        super().__init__(max_tokens, size_of=lambda embedding: embedding.num_tokens, keep_oversized=True)
