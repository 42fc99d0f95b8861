"""Image embeddings by content hash, least recently used first out, bounded by tokens.

An image is encoded once and reused by every prefill chunk that covers part of
it, by a request recomputing after preemption, and by other requests showing
the same picture. Entries are evicted when the total would pass `max_tokens`;
the model runner holds its own references for the step in progress, so an
eviction never pulls features from under a running step.
"""

from __future__ import annotations

import torch

from vlm_catalog.model.config import ModelConfig
from vlm_catalog.model.qwen3_vl_moe import ImageEmbedding
from vlm_catalog.sized_lru import SizedLRU


class EncoderCache(SizedLRU[ImageEmbedding]):
    """`SizedLRU` of image embeddings by content hash, bounded in tokens; the newest entry
    always stays, so an image larger than the cache still serves all its prefill chunks."""

    def __init__(self, max_tokens: int) -> None:
        super().__init__(max_tokens, size_of=lambda embedding: embedding.num_tokens, keep_oversized=True)


def encoder_cache_bytes(max_tokens: int, config: ModelConfig, dtype: torch.dtype) -> int:
    """The device memory an encoder cache of `max_tokens` holds when full: per language-model
    token an embedding and one per deepstack layer, each `hidden_size` wide (the model runner
    caches copies of each image's own rows, `ImageEmbedding.owning`)."""
    per_token = (1 + len(config.vision.deepstack_visual_indexes)) * config.text.hidden_size * dtype.itemsize
    return max_tokens * per_token
