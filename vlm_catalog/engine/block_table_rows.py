"""The step's block tables, gathered from rows of one preallocated table that change only where they grew.

The attention kernels take the block tables of a step's requests as one
[B, width] int32 tensor. Built from Python lists at every step (pad each,
then `torch.tensor`), that cost O(B x blocks) on the host, in series with
the device: at the benchmark's contexts (1,000-5,000 tokens, 70-300 blocks of
16) and 256 decoding requests, 1-3 ms per decode step. Here each request owns
a row of a host table; a step writes only the blocks a request gained since
its last step (a decode gains one every 16 tokens) and gathers the step's rows
in one indexing copy.

A row stays valid while the request's block list is the same list object
(`BlockManager` appends to a request's list and makes a new one when the
request is allocated again after a preemption), so no one has to tell the
rows about preemptions or finished requests: the rows of requests not seen
for longest are reused when none is free.

The width is the longest list's, rounded up to a multiple of `WIDTH_MULTIPLE` (within the
table): the kernels' row stride then always divides by 16, so Triton compiles one variant for
every step instead of one per class of widths (1, a multiple of 16, any other), which a
serving engine would meet first in the middle of a run (kernels/jit/__init__.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

WIDTH_MULTIPLE = 16  # columns of a gathered table: a row stride Triton specializes as divisible by 16


@dataclass
class _Row:
    index: int
    blocks: list[int]  # the request's block list this row mirrors (identity is what counts)
    written: int  # leading entries of `blocks` copied into the row


class BlockTableRows:
    """Block tables of up to `max_rows` requests, `max_blocks` blocks each."""

    def __init__(self, max_rows: int, max_blocks: int) -> None:
        if max_rows < 1 or max_blocks < 1:
            raise ValueError(f"need at least one row of at least one block, got {max_rows} x {max_blocks}")
        self.max_blocks = max_blocks
        self._table = np.zeros((max_rows, max_blocks), dtype=np.int32)  # [rows, blocks]
        self._rows: OrderedDict[Hashable, _Row] = OrderedDict()  # least recently gathered first
        self._free = list(range(max_rows - 1, -1, -1))

    def gather(self, requests: Sequence[tuple[Hashable, list[int]]]) -> torch.Tensor:
        """[len(requests), width] int32 (host): each (request id, block list)'s blocks, zero-padded to the
        longest rounded up to `WIDTH_MULTIPLE` (or the table's width, if that is less).

        The block lists must be the block manager's own lists (see module doc).
        """
        rows: list[int] = []
        width = 1
        for request_id, blocks in requests:
            row = self._row(request_id, blocks, in_use=len(rows))
            if len(blocks) > row.written:
                if len(blocks) > self.max_blocks:
                    raise ValueError(f"request {request_id!r} has {len(blocks)} blocks; rows hold {self.max_blocks}")
                self._table[row.index, row.written : len(blocks)] = blocks[row.written :]
                row.written = len(blocks)
            rows.append(row.index)
            width = max(width, len(blocks))
        width = min(self.max_blocks, -(-width // WIDTH_MULTIPLE) * WIDTH_MULTIPLE)
        return torch.from_numpy(self._table[rows, :width])  # fancy indexing copies: [B, width]

    def _row(self, request_id: Hashable, blocks: list[int], in_use: int) -> _Row:
        row = self._rows.get(request_id)
        if row is not None and row.blocks is blocks:
            self._rows.move_to_end(request_id)
            return row
        if row is None:
            index = self._take_row(in_use)
        else:  # allocated afresh (after a preemption): the same row, rewritten
            index = row.index
        self._table[index].fill(0)
        row = self._rows[request_id] = _Row(index, blocks, 0)
        self._rows.move_to_end(request_id)
        return row

    def _take_row(self, in_use: int) -> int:
        if self._free:
            return self._free.pop()
        if len(self._rows) <= in_use:  # every row already holds a request of this gather
            raise ValueError(f"more than {len(self._rows)} requests in one step; rows hold {len(self._rows)}")
        _, oldest = self._rows.popitem(last=False)  # not gathered in this step: the ones gathered were moved last
        return oldest.index
