"""moe_align_block_size: the reference's layout invariants, and Triton == reference exactly."""

from __future__ import annotations

import importlib

import pytest
import torch

import kernels
from kernels.moe.align import (
    expert_counts,
    moe_align_block_size_reference,
    moe_align_block_size_triton,
)
from tests.kernels.moe_layout import assert_alignment_matches_reference, check_layout

align_module = importlib.import_module("kernels.moe.align")


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


@pytest.mark.parametrize("launches", ["one", "three"])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_size", CASES)
def test_triton_equals_reference(
    triton_device, poison_allocations, monkeypatch, launches, ids_dtype, num_tokens, top_k, num_experts, block_size
):
    # exact: the Triton version is deterministic and keeps the pair order of a stable sort. Its
    # outputs start out poisoned (no fill launches), so an entry it forgets inside the used part
    # shows; past the used part they are unspecified. "one": the scatter programs count for
    # themselves (in steps of 8 pairs here, so several steps); "three": counted per chunk of 32
    # pairs here (up to 4 chunks, so the larger cases use chunks of 64 to 512), offsets, scatter
    monkeypatch.setattr(align_module, "SINGLE_LAUNCH_MAX_PAIRS", 10**9 if launches == "one" else 0)
    monkeypatch.setattr(align_module, "COUNT_TILE", 8 * 128)
    monkeypatch.setattr(align_module, "ALIGN_CHUNK_PAIRS", 32)
    monkeypatch.setattr(align_module, "MAX_ALIGN_CHUNKS", 4)
    topk_ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])
    topk_ids = topk_ids.to(ids_dtype).to(triton_device)
    got = kernels.moe_align_block_size(topk_ids, num_experts, block_size)
    assert_alignment_matches_reference(got, topk_ids, num_experts, block_size)

def test_chunks_are_powers_of_two_and_never_more_than_the_offsets_program_holds():
    for num_pairs in (129, 1024, 1025, 8 * 1000, 8 * 16384, 8 * 32768):
        size = align_module.align_chunk_size(num_pairs)
        assert size & (size - 1) == 0 and size >= align_module.ALIGN_CHUNK_PAIRS
        assert -(-num_pairs // size) <= align_module.MAX_ALIGN_CHUNKS
    assert align_module.align_chunk_size(8 * 16384) == 2048  # a 16k-token prefill: 64 chunks


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


def test_expert_counts_count_each_experts_pairs_without_reading_the_device():
    from tests.kernels.device_waits import DeviceWaits

    ids = torch.tensor([[3, 0], [0, 3], [3, 1]], dtype=torch.int32)
    with DeviceWaits() as mode:
        counts = expert_counts(ids, num_experts=6)
    assert not mode.waits, mode.waits
    assert counts.dtype == torch.int64 and counts.tolist() == [2, 1, 0, 3, 0, 0]  # experts 2, 4, 5: none
    assert torch.equal(counts, torch.bincount(ids.flatten().long(), minlength=6))
