"""A least-recently-used cache bounded by the total size of its entries (tokens, patches, ...)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class SizedLRU(Generic[V]):
    """Entries are evicted, least recently used first, while their sizes add up to more than `max_size`.

    `keep_oversized`: an entry larger than `max_size` on its own is kept (alone) until the
    next `put`, instead of not being stored at all. The encoder cache wants this: an image
    bigger than the cache is still reused by the later prefill chunks of the same prompt.
    """

    def __init__(self, max_size: int, size_of: Callable[[V], int], keep_oversized: bool = False) -> None:
        self.max_size = max_size
        self.size_of = size_of
        self.keep_oversized = keep_oversized
        self._entries: OrderedDict[Hashable, V] = OrderedDict()
        self.size = 0  # the sum of the entries' sizes
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def values(self) -> list[V]:
        """The entries, least recently used first (without counting hits or refreshing them)."""
        return list(self._entries.values())

    def get(self, key: Hashable) -> V | None:
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return value

    def put(self, key: Hashable, value: V) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        size = self.size_of(value)
        if size > self.max_size and not self.keep_oversized:
            return  # larger than the whole cache: not stored
        self._entries[key] = value
        self.size += size
        while self.size > self.max_size and len(self._entries) > 1:
            _, evicted = self._entries.popitem(last=False)
            self.size -= self.size_of(evicted)

    def clear(self) -> None:
        self._entries.clear()
        self.size = 0

    def reset(self) -> None:
        """Empty, with the hit and miss counts at zero: as new."""
        self.clear()
        self.hits = self.misses = 0
