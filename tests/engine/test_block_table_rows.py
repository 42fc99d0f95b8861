"""`BlockTableRows` against the tables built from the lists each step (zero-padded `torch.tensor`)."""

from __future__ import annotations

import random

import pytest
import torch

from vlm_catalog.engine.block_table_rows import WIDTH_MULTIPLE, BlockTableRows


def padded(lists: list[list[int]], max_blocks: int) -> torch.Tensor:
    """The reference: what the runner built before, every step from scratch, zero-padded to a
    width of whole `WIDTH_MULTIPLE`s (at most `max_blocks`)."""
    longest = max(1, *(len(blocks) for blocks in lists))
    width = min(max_blocks, -(-longest // WIDTH_MULTIPLE) * WIDTH_MULTIPLE)
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
        assert torch.equal(gathered, padded([tables[name] for name in step_requests], 64)), step
        assert gathered.shape[1] % WIDTH_MULTIPLE == 0  # one Triton variant whatever the step (kernels/jit)


def test_a_request_allocated_afresh_gets_its_new_blocks_and_zero_padding():
    rows = BlockTableRows(max_rows=2, max_blocks=8)
    first = [5, 6, 7, 8]
    other = [1, 2, 3]
    rows.gather([("a", first), ("b", other)])
    again = [9]  # a new list after a preemption: shorter, other blocks
    assert rows.gather([("a", again), ("b", other)]).tolist() == [[9] + [0] * 7, [1, 2, 3] + [0] * 5]  # the table's 8


def test_rows_not_used_for_longest_are_reused_when_none_is_free():
    rows = BlockTableRows(max_rows=2, max_blocks=4)
    a, b, c = [1], [2, 2], [3, 3, 3]
    rows.gather([("a", a), ("b", b)])
    rows.gather([("b", b)])
    assert rows.gather([("c", c)]).tolist() == [[3, 3, 3, 0]]  # takes a's row (the table's 4 columns)
    assert rows.gather([("a", a), ("c", c)]).tolist() == [[1, 0, 0, 0], [3, 3, 3, 0]]  # a comes back (in b's row)


def test_the_width_is_a_whole_number_of_16s_within_the_table():
    rows = BlockTableRows(max_rows=3, max_blocks=40)
    assert rows.gather([("a", [7])]).shape == (1, 16)  # never 1: Triton would compile that width apart
    assert rows.gather([("a", [7]), ("b", list(range(17)))]).shape == (2, 32)
    assert rows.gather([("c", list(range(33)))]).shape == (1, 40)  # the table's width caps it
    assert rows.gather([("b", list(range(17)))])[0, 17:].eq(0).all()


def test_too_many_requests_or_blocks_are_refused():
    rows = BlockTableRows(max_rows=2, max_blocks=4)
    with pytest.raises(ValueError, match="more than 2 requests in one step"):
        rows.gather([("a", [1]), ("b", [2]), ("c", [3])])
    with pytest.raises(ValueError, match="has 5 blocks; rows hold 4"):
        rows.gather([("d", [1, 2, 3, 4, 5])])
    with pytest.raises(ValueError, match="at least one row"):
        BlockTableRows(0, 4)
