"""Content hashes of full KV blocks, for prefix caching.

Block i's hash covers block i-1's hash, its token ids and, for image
placeholder tokens inside it, which image (content hash) and which rows of
that image: all image placeholders share one token id, so tokens alone would
let two different pictures collide. Equal hashes therefore mean equal KV
contents (MRoPE positions depend only on what precedes, which the chain covers).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    image_spans: Sequence[tuple[int, int]] = (),
    image_hashes: Sequence[str] = (),
    start_block: int = 0,
    previous: bytes = b"",
) -> list[bytes]:
    """Hashes of the full blocks from `start_block` on; `previous` is block start_block-1's hash."""
    hashes: list[bytes] = []
    num_full = len(token_ids) // block_size
    for block in range(start_block, num_full):
        start, end = block * block_size, (block + 1) * block_size
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(array("q", token_ids[start:end]).tobytes())
        for (span_start, span_length), image_hash in zip(image_spans, image_hashes):
            overlap_start, overlap_end = max(start, span_start), min(end, span_start + span_length)
            if overlap_start < overlap_end:
                digest.update(f"|{image_hash}:{overlap_start - span_start}:{overlap_end - span_start}".encode())
        previous = digest.digest()
        hashes.append(previous)
    return hashes
