"""Which records a run processes: a shard of the dataset, the first N, minus those done.

`--shard I/N` keeps the records whose id hashes to I modulo N. The hash is
BLAKE2b of the id's text, so it depends on nothing but the id: the same record
is in the same shard on every machine and every resume, and the N shards
partition the dataset.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Container, Iterator
from dataclasses import dataclass

_SHARD = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        """`"I/N"` with 0 <= I < N; raise ValueError naming the problem."""
        match = _SHARD.match(text or "")
        if not match:
            raise ValueError(f"--shard must look like I/N (e.g. 0/4), got {text!r}")
        index, count = int(match.group(1)), int(match.group(2))
        if count < 1 or not 0 <= index < count:
            raise ValueError(f"--shard {text}: need N >= 1 and 0 <= I < N")
        return cls(index, count)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def contains(self, record_id: str) -> bool:
        if self.count == 1:
            return True
        digest = hashlib.blake2b(record_id.encode("utf-8"), digest_size=8, person=b"vlm-shard").digest()
        return int.from_bytes(digest, "big") % self.count == self.index


WHOLE = Shard(0, 1)


def selected_indices(num_records: int, shard: Shard = WHOLE, limit: int | None = None) -> Iterator[int]:
    """Row indices of the shard's records in order, the first `limit` of them."""
    taken = 0
    for index in range(num_records):
        if limit is not None and taken >= limit:
            return
        if shard.contains(str(index)):
            taken += 1
            yield index


def count_selected(num_records: int, shard: Shard = WHOLE, limit: int | None = None) -> int:
    if shard.count == 1:
        return num_records if limit is None else min(limit, num_records)
    return sum(1 for _ in selected_indices(num_records, shard, limit))


def pending_indices(
    num_records: int, done: Container[int], shard: Shard = WHOLE, limit: int | None = None
) -> Iterator[int]:
    """The selected indices not yet in the results file."""
    return (index for index in selected_indices(num_records, shard, limit) if index not in done)
