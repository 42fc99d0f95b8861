"""Image embeddings by content hash, least recently used first out, bounded by tokens.

An image is encoded once and reused by every prefill chunk that covers part of
it, by a request recomputing after preemption, and by other requests showing
the same picture. Entries are evicted when the total would pass `max_tokens`;
the model runner holds its own references for the step in progress, so an
eviction never pulls features from under a running step.
"""

from __future__ import annotations

from collections import OrderedDict

from vlm_catalog.model.qwen3_vl_moe import ImageEmbedding


class EncoderCache:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, ImageEmbedding] = OrderedDict()
        self.num_tokens = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._entries

    def get(self, content_hash: str) -> ImageEmbedding | None:
        embedding = self._entries.get(content_hash)
        if embedding is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(content_hash)
        return embedding

    def put(self, content_hash: str, embedding: ImageEmbedding) -> None:
        if content_hash in self._entries:
            self._entries.move_to_end(content_hash)
            return
        self._entries[content_hash] = embedding
        self.num_tokens += embedding.num_tokens
        while self.num_tokens > self.max_tokens and len(self._entries) > 1:
            _, evicted = self._entries.popitem(last=False)
            self.num_tokens -= evicted.num_tokens
