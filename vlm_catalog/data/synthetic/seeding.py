"""Process-independent hashing and per-record random streams.

Python's `hash()` of a string changes from one process to the next, so every
"stable" choice in the generator goes through `stable_int`, a SHA-256 digest.
Each record draws from its own streams, seeded from (stream name, seed, index),
so record i never depends on how many records come before or after it.
"""

from __future__ import annotations

import hashlib
import random


def stable_int(*parts: object) -> int:
    """A 64-bit integer that depends only on the text of `parts`, the same in every process."""
    text = "\x1f".join(str(part) for part in parts)
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def record_rng(stream: str, seed: int, index: int) -> random.Random:
    """Random stream `stream` ("content", "image", ...) of record `index` in catalogue `seed`."""
    return random.Random(stable_int("vlm-catalog synthetic", stream, seed, index))
