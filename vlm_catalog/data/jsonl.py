"""Read a JSONL file line by line: lines end only at b"\\n", and each is bounded in size.

Two traps this avoids:
- `str.splitlines()` also splits at U+0085, U+2028, U+2029 and a few control
  characters. `json.dumps(..., ensure_ascii=False)` leaves those raw inside
  strings, and scraped product text carries them (U+0085 is what cp1252's "…"
  becomes when read as Latin-1). Splitting there cuts a valid line in two.
- Iterating a file reads a whole line into memory, however long. A file with no
  newline (a JSON array, a binary file) would be read whole. Here a line longer
  than `MAX_LINE_BYTES` is reported, its first `MAX_LINE_BYTES` read and dropped
  and the rest skipped in 1 MiB chunks: a reader holds at most about twice
  `MAX_LINE_BYTES`, whatever the file.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

# Longer than any product record or model answer by orders of magnitude
# (images in JSONL are paths, not inline bytes).
MAX_LINE_BYTES = 16 * 2**20
_SKIP_CHUNK_BYTES = 2**20


@dataclass(slots=True)
class JsonlLine:
    """One line: its 1-based number, its byte offset, and its bytes (None when too long)."""

    number: int
    offset: int
    size: int
    raw: bytes | None

    @property
    def is_blank(self) -> bool:
        return self.raw is not None and self.raw.isspace()  # readline never gives b""

    def too_long_message(self) -> str:
        return f"the line has {self.size} bytes, over the limit of {MAX_LINE_BYTES}"


def read_lines(handle: BinaryIO) -> Iterator[JsonlLine]:
    """The lines of a binary file from its current position, numbered from 1 there (a pipe's
    offsets count from there too)."""
    offset = handle.tell() if handle.seekable() else 0
    number = 0
    while True:
        raw = handle.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        number += 1
        size = len(raw)
        if size > MAX_LINE_BYTES:
            while not raw.endswith(b"\n"):  # skip the rest of the line without holding it
                raw = handle.readline(_SKIP_CHUNK_BYTES)
                if not raw:
                    break
                size += len(raw)
            yield JsonlLine(number, offset, size, None)
        else:
            yield JsonlLine(number, offset, size, raw)
        offset += size
