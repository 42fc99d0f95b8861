"""`BlockTableRows` against the tables built from the lists each step (zero-padded `torch.tensor`)."""

from __future__ import annotations

import random

import pytest
import torch

from vlm_catalog.engine.block_table_rows import BlockTableRows


def padded(lists: list[list[int]]) -> torch.Tensor:
    """The reference: what the runner built before, every step from scratch."""
    width = max(1, *(len(blocks) for blocks in lists))
    return torch.tensor([blocks + [0] * (width - len(blocks)) for blocks in lists], dtype=torch.int32)


def test_growing_tables_over_many_steps_match_the_rebuilt_reference():
    rng = random.Random(0)
    rows = BlockTableRows(max_rows=12, max_blocks=64)
    tables: dict[str, list[int]] = {}
    for step in range(200):
        for name in list(tables):
            if rng.random() < 0.05:
                del tables[name]  # finished: its row is left for reuse
            elif rng.random() < 0.1:
                tables[name] = [rng.randrange(1000) for _ in range(rng.randrange(1, 5))]  # preempted, allocated afresh
            elif rng.random() < 0.3 and len(tables[name]) < 64:
                tables[name].append(rng.randrange(1000))  # grew by a block, in place
        while len(tables) < 10:
            tables[f"r{step}-{len(tables)}"] = [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
        step_requests = rng.sample(sorted(tables), rng.randrange(1, len(tables) + 1))
        gathered = rows.gather([(name, tables[name]) for name in step_requests])
        assert gathered.dtype == torch.int32
        assert torch.equal(gathered, padded([tables[name] for name in step_requests])), step


def test_a_request_allocated_afresh_gets_its_new_blocks_and_zero_padding():
    rows = BlockTableRows(max_rows=2, max_blocks=8)
    first = [5, 6, 7, 8]
    other = [1, 2, 3]
    rows.gather([("a", first), ("b", other)])
    again = [9]  # a new list after a preemption: shorter, other blocks
    assert rows.gather([("a", again), ("b", other)]).tolist() == [[9, 0, 0], [1, 2, 3]]


def test_rows_not_used_for_longest_are_reused_when_none_is_free():
    rows = BlockTableRows(max_rows=2, max_blocks=4)
    a, b, c = [1], [2, 2], [3, 3, 3]
    rows.gather([("a", a), ("b", b)])
    rows.gather([("b", b)])
    assert rows.gather([("c", c)]).tolist() == [[3, 3, 3]]  # takes a's row
    assert rows.gather([("a", a), ("c", c)]).tolist() == [[1, 0, 0], [3, 3, 3]]  # a comes back (in b's row)


def test_too_many_requests_or_blocks_are_refused():
    rows = BlockTableRows(max_rows=2, max_blocks=4)
    with pytest.raises(ValueError, match="more than 2 requests in one step"):
        rows.gather([("a", [1]), ("b", [2]), ("c", [3])])
    with pytest.raises(ValueError, match="has 5 blocks; rows hold 4"):
        rows.gather([("d", [1, 2, 3, 4, 5])])
    with pytest.raises(ValueError, match="at least one row"):
        BlockTableRows(0, 4)
