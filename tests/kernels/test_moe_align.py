"""moe_align_block_size: the reference's layout invariants, and Triton == reference exactly."""

from __future__ import annotations

import importlib

import pytest
import torch

import kernels
from kernels.moe.align import (
    max_padded_pairs,
    moe_align_block_size_reference,
    moe_align_block_size_triton,
)

align_module = importlib.import_module("kernels.moe.align")


def check_layout(
    topk_ids: torch.Tensor, num_experts: int, block_size: int, sorted_ids, expert_ids, num_post
):
    """Independent check of the documented layout."""
    flat = topk_ids.reshape(-1).tolist()
    num_pairs = len(flat)
    counts = [flat.count(e) for e in range(num_experts)]
    padded = [-(-c // block_size) * block_size for c in counts]
    used = int(num_post.item())
    assert used == sum(padded)
    assert sorted_ids.numel() == max_padded_pairs(num_pairs, num_experts, block_size) >= used
    assert (
        sorted_ids.numel() % block_size == 0
        and expert_ids.numel() == sorted_ids.numel() // block_size
    )
    # entries past `used` are unspecified (the GEMMs never read them)
    sorted_list, expert_list = sorted_ids[:used].tolist(), expert_ids[: used // block_size].tolist()
    real = [entry for entry in sorted_list[:used] if entry != num_pairs]
    assert sorted(real) == list(range(num_pairs)), "every pair exactly once"
    start = 0
    for expert in range(num_experts):
        segment = sorted_list[start : start + padded[expert]]
        pairs = [entry for entry in segment if entry != num_pairs]
        assert [flat[p] for p in pairs] == [expert] * counts[expert]
        assert pairs == sorted(pairs), "pairs keep their order within an expert"
        assert segment[: counts[expert]] == pairs, "padding goes at the end of an expert's segment"
        assert expert_list[start // block_size : (start + padded[expert]) // block_size] == [
            expert
        ] * (padded[expert] // block_size)
        start += padded[expert]


CASES = [
    # (T, K, E, block size)
    (1, 8, 128, 16),  # one decode token: 8 experts, 8 blocks of mostly padding
    (37, 3, 6, 4),
    (20, 2, 9, 1),
    (5, 4, 64, 16),  # most experts unused
    (300, 8, 16, 32),  # several blocks per expert, longer than one scan chunk
]


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_size", CASES)
def test_reference_layout(num_tokens, top_k, num_experts, block_size):
    topk_ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])
    check_layout(
        topk_ids,
        num_experts,
        block_size,
        *moe_align_block_size_reference(topk_ids, num_experts, block_size),
    )


def test_reference_fills_the_unused_tail():
    topk_ids = torch.tensor([[3, 1]])
    sorted_ids, expert_ids, num_post = moe_align_block_size_reference(topk_ids, 4, 4)
    used = int(num_post)
    assert used == 8 and sorted_ids[used:].eq(2).all() and expert_ids[used // 4 :].eq(-1).all()


@pytest.mark.parametrize("launches", ["one", "two"])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_size", CASES)
def test_triton_equals_reference(
    triton_device, poison_allocations, monkeypatch, launches, ids_dtype, num_tokens, top_k, num_experts, block_size
):
    # exact: the Triton version is deterministic and keeps the pair order of a stable sort. Its
    # outputs start out poisoned (no fill launches), so an entry it forgets inside the used part
    # shows; past the used part they are unspecified. "one": the scatter programs count for
    # themselves (in steps of 8 pairs here, so several steps); "two": a count launch first
    monkeypatch.setattr(align_module, "SINGLE_LAUNCH_MAX_PAIRS", 10**9 if launches == "one" else 0)
    monkeypatch.setattr(align_module, "COUNT_TILE", 8 * 128)
    topk_ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])
    topk_ids = topk_ids.to(ids_dtype).to(triton_device)
    got = kernels.moe_align_block_size(topk_ids, num_experts, block_size)
    expected = moe_align_block_size_reference(topk_ids, num_experts, block_size)
    used = int(expected[2])
    assert all(actual.dtype == torch.int32 for actual in got)
    assert torch.equal(got[2], expected[2]), "num_tokens_post_padded"
    assert got[0].shape == expected[0].shape and got[1].shape == expected[1].shape
    assert torch.equal(got[0][:used], expected[0][:used]), "sorted_token_ids"
    assert torch.equal(got[1][: used // block_size], expected[1][: used // block_size]), "expert_ids"
    check_layout(topk_ids.cpu(), num_experts, block_size, *(tensor.cpu() for tensor in got))


def test_triton_no_tokens(triton_device):
    topk_ids = torch.empty(0, 8, dtype=torch.int32, device=triton_device)
    sorted_ids, expert_ids, num_post = moe_align_block_size_triton(topk_ids, 16, 16)
    assert sorted_ids.numel() == 0 and expert_ids.numel() == 0 and int(num_post) == 0


@pytest.mark.gpu
def test_gpu_align_model_shapes(cuda_device):
    topk_ids = (
        torch.stack([torch.randperm(128)[:8] for _ in range(8192)]).to(torch.int32).to(cuda_device)
    )
    got = kernels.moe_align_block_size(topk_ids, 128, 64)
    wanted = moe_align_block_size_reference(topk_ids, 128, 64)
    used = int(wanted[2])
    assert torch.equal(got[2], wanted[2])
    assert torch.equal(got[0][:used], wanted[0][:used]) and torch.equal(got[1][: used // 64], wanted[1][: used // 64])
