"""Batched bitmask application: only grammar rows, -inf on disallowed, every dtype/device."""

from __future__ import annotations

import pytest
import torch

from vlm_catalog.structured import allocate_bitmask, apply_bitmask
from vlm_catalog.structured.bitmask import (
    allow_only_token,
    allow_only_tokens,
    row_allows_only,
    row_token_ids,
)

VOCAB = 1024


def reference_mask(allowed: list[set[int]], vocab: int) -> torch.Tensor:
    mask = torch.zeros(len(allowed), vocab, dtype=torch.bool)
    for row, ids in enumerate(allowed):
        mask[row, sorted(ids)] = True
    return mask


def random_bitmask(batch: int, generator: torch.Generator) -> tuple[torch.Tensor, list[set[int]]]:
    bitmask = allocate_bitmask(batch, VOCAB)
    allowed = []
    for row in range(batch):
        ids = set(torch.randint(0, VOCAB, (50,), generator=generator).tolist()) | {31, 63}
        bitmask[row].zero_()
        for token in ids:
            word, bit = divmod(token, 32)
            bitmask[row, word] |= torch.tensor(1 << bit).to(torch.int32)
        allowed.append(ids)
    return bitmask, allowed


def check_apply(device: str, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    bitmask, allowed = random_bitmask(5, generator)
    logits = torch.randn(5, VOCAB, generator=generator).to(device=device, dtype=dtype)
    original = logits.clone()
    rows = [0, 2, 3]
    apply_bitmask(logits, bitmask, rows)
    expected = original.clone()
    keep = reference_mask(allowed, VOCAB).to(device)
    expected[rows] = expected[rows].masked_fill(~keep[rows], float("-inf"))
    assert torch.equal(logits, expected)  # rows 1 and 4 (no grammar) untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_matches_reference_on_cpu(dtype):
    check_apply("cpu", dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_matches_reference_on_cuda(dtype):
    check_apply("cuda", dtype)


def test_allow_only_and_readback_handle_the_sign_bit():
    bitmask = allocate_bitmask(1, VOCAB)
    for token in (0, 31, 32, 63, 1023):
        allow_only_token(bitmask, 0, token)
        assert row_token_ids(bitmask[0], VOCAB) == [token]
        assert row_allows_only(bitmask[0], [token, 5])
        assert not row_allows_only(bitmask[0], [5])


def test_allow_only_tokens_writes_what_allow_only_token_writes_row_by_row():
    rows, tokens = [4, 0, 2], [31, 1023, 32]  # the sign bit, the last word, a word's first bit
    batched, one_by_one = allocate_bitmask(5, VOCAB), allocate_bitmask(5, VOCAB)
    batched[2, 7] = 12345  # a row's other words are cleared, not kept
    allow_only_tokens(batched, rows, tokens)
    for row, token in zip(rows, tokens):
        allow_only_token(one_by_one, row, token)
    assert torch.equal(batched, one_by_one)
    assert [row_token_ids(batched[row], VOCAB) for row in rows] == [[token] for token in tokens]
    assert (batched[1] == -1).all() and (batched[3] == -1).all()  # rows not listed: untouched
    allow_only_tokens(batched, [], [])  # nothing forced this step
    assert torch.equal(batched, one_by_one)
    with pytest.raises(ValueError, match="2 rows for 1 tokens"):
        allow_only_tokens(batched, [0, 1], [5])


@pytest.mark.parametrize("inference", [False, True], ids=["plain logits", "inference-mode logits"])
@pytest.mark.parametrize("rows", [[0, 2], [0, 1, 2]], ids=["some rows", "every row"])
def test_columns_past_the_bitmask_are_never_allowed_in_its_rows(rows, inference):
    """A grammar row covers the tokenizer's ids; the logits' padding past them is -inf in the
    listed rows (the rest untouched, within the covered columns too); the engine's logits come
    from an inference-mode forward and are masked outside it."""
    generator = torch.Generator().manual_seed(1)
    bitmask, allowed = random_bitmask(3, generator)  # covers VOCAB = 1024 ids
    with torch.inference_mode(inference):
        logits = torch.randn(3, VOCAB + 300, generator=generator)
    before = logits.clone()
    apply_bitmask(logits, bitmask, rows)
    for row in range(3):
        if row in rows:
            expected = before[row].clone()
            expected[:VOCAB][~reference_mask([allowed[row]], VOCAB)[0]] = float("-inf")
            expected[VOCAB:] = float("-inf")
            assert torch.equal(logits[row], expected)
        else:
            assert torch.equal(logits[row], before[row])


def test_shape_errors_are_clear():
    bitmask = allocate_bitmask(2, VOCAB)
    with pytest.raises(ValueError, match="rows must be unique"):
        apply_bitmask(torch.zeros(2, VOCAB), bitmask, [1, 1])
    with pytest.raises(ValueError, match=r"rows \[2\] are outside the batch of 2"):
        apply_bitmask(torch.zeros(2, VOCAB), bitmask, [2])
    with pytest.raises(ValueError, match="int32"):
        apply_bitmask(torch.zeros(2, VOCAB), bitmask.to(torch.int64), [0])
    logits = torch.zeros(2, VOCAB)
    apply_bitmask(logits, bitmask, [])  # nothing to do
    assert torch.equal(logits, torch.zeros(2, VOCAB))
