"""Checks of the expert-sorted layout of `kernels.moe.align`, shared by the align and the
fused route-and-align tests."""

from __future__ import annotations

import torch

from kernels.moe.align import max_padded_pairs, moe_align_block_size_reference


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


def assert_alignment_matches_reference(got, topk_ids: torch.Tensor, num_experts: int, block_size: int) -> None:
    """(sorted_token_ids, expert_ids, num_tokens_post_padded) equal the reference's exactly over
    the used part (past it they are unspecified), and satisfy the documented layout."""
    sorted_ids, expert_ids, num_post = got[:3]
    expected = moe_align_block_size_reference(topk_ids, num_experts, block_size)
    used = int(expected[2])
    assert all(actual.dtype == torch.int32 for actual in (sorted_ids, expert_ids, num_post))
    assert torch.equal(num_post.cpu(), expected[2].cpu()), "num_tokens_post_padded"
    assert sorted_ids.shape == expected[0].shape and expert_ids.shape == expected[1].shape
    assert torch.equal(sorted_ids[:used].cpu(), expected[0][:used].cpu()), "sorted_token_ids"
    assert torch.equal(expert_ids[: used // block_size].cpu(), expected[1][: used // block_size].cpu()), "expert_ids"
    check_layout(topk_ids.cpu(), num_experts, block_size, sorted_ids.cpu(), expert_ids.cpu(), num_post.cpu())
