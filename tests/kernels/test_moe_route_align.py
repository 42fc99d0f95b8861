"""route_topk_and_align: routing and the expert-sorted layout in one launch (decode batches),
against the two stages it replaces, and fused_moe taking the layout it made."""

from __future__ import annotations

import importlib

import pytest
import torch

import kernels
from kernels.moe.fused_moe import fused_moe_triton
from kernels.moe.routing import route_topk_and_align_triton, route_topk_reference
from tests.kernels.moe_layout import assert_alignment_matches_reference

routing_module = importlib.import_module("kernels.moe.routing")

CASES = [
    # (T, E, K, block size)
    (1, 128, 8, 16),  # one decode token at the 30B-A3B shapes
    (16, 128, 8, 16),  # the largest batch the dispatcher gives the fused kernel by default
    (32, 128, 8, 16),  # 16 warps
    (7, 60, 4, 16),  # neither T nor E a power of two
    (3, 6, 6, 4),  # every token picks every expert, expert 0 included; K not a power of two
    (5, 9, 3, 1),
    (17, 64, 8, 32),
]


def check_routing(weights, ids, logits, top_k, renormalize, weights_dtype):
    # tolerance: as route_topk's (float32 softmax either way: 1e-6 relative; within one unit of a
    # 16-bit weights dtype, whose rounding a last-bit difference can flip); ids exact (float32
    # logits: no ties)
    expected_weights, expected_ids = route_topk_reference(logits, top_k, renormalize)
    assert weights.dtype == weights_dtype and ids.dtype == torch.int32
    assert torch.equal(ids, expected_ids)
    if weights_dtype == torch.float32:
        torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)
    else:
        unit = torch.finfo(weights_dtype).eps
        torch.testing.assert_close(weights.float(), expected_weights.to(weights_dtype).float(), rtol=unit, atol=0)


def routing_settings(num_experts: int) -> list[tuple[bool, torch.dtype]]:
    """(renormalize, weights dtype) pairs to run a case with: every pair for the small cases,
    two that between them take each setting once at 128 experts, where one launch runs 128
    programs (about 10 s each under the interpreter)."""
    if num_experts >= 128:
        return [(True, torch.float32), (False, torch.bfloat16)]
    return [(renormalize, dtype) for renormalize in (True, False) for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_size,renormalize,weights_dtype", [
    pytest.param(*case, renormalize, dtype,
                 id="T{}-E{}-K{}-block{}".format(*case) + f"-{'renormalized' if renormalize else 'raw'}-{str(dtype).removeprefix('torch.')}")
    for case in CASES for renormalize, dtype in routing_settings(case[1])])
def test_one_launch_equals_route_then_align(
    triton_device, poison_allocations, weights_dtype, renormalize, num_tokens, num_experts, top_k, block_size
):
    # every output starts poisoned, so an entry the kernel forgets (inside the used part) shows
    logits = torch.randn(num_tokens, num_experts, device=triton_device)
    weights, ids, alignment = route_topk_and_align_triton(logits, top_k, renormalize, weights_dtype, block_size)
    assert alignment.block_size == block_size
    check_routing(weights, ids, logits, top_k, renormalize, weights_dtype)
    assert_alignment_matches_reference(alignment, ids, num_experts, block_size)


def test_strided_logits_rows(triton_device):
    # the router's output may be a view with a row stride wider than E
    wide = torch.randn(9, 200, device=triton_device)
    logits = wide[:, :128]
    weights, ids, alignment = route_topk_and_align_triton(logits, 8, True, torch.float32, 16)
    check_routing(weights, ids, logits.contiguous(), 8, True, torch.float32)
    assert_alignment_matches_reference(alignment, ids, 128, 16)


def test_larger_batches_and_the_reference_path_route_only(triton_device, monkeypatch):
    # past ROUTE_ALIGN_MAX_TOKENS (or on the reference path) it routes and leaves the layout to fused_moe
    logits = torch.randn(routing_module.ROUTE_ALIGN_MAX_TOKENS + 1, 128, device=triton_device)
    weights, ids, alignment = kernels.route_topk_and_align(logits, 8, block_size=16)
    assert alignment is None
    check_routing(weights, ids, logits, 8, True, torch.float32)
    assert kernels.route_topk_and_align(logits[:4], 8, block_size=16)[2] is not None
    monkeypatch.setenv("VLM_CATALOG_KERNELS", "reference")
    assert kernels.route_topk_and_align(logits[:4], 8, block_size=16)[2] is None


def test_the_token_and_tile_bounds(monkeypatch):
    # at most ROUTE_ALIGN_MAX_TOKENS tokens, and [BLOCK_T, BLOCK_EXPERTS] logits per program:
    # at 512 experts, 16 tokens at most; at 60 (64 in the tile), 128
    monkeypatch.setattr(routing_module, "ROUTE_ALIGN_MAX_TOKENS", 1000)
    assert routing_module.routes_and_aligns_in_one_launch(16, 512)
    assert not routing_module.routes_and_aligns_in_one_launch(17, 512)
    assert routing_module.routes_and_aligns_in_one_launch(128, 60)
    assert not routing_module.routes_and_aligns_in_one_launch(129, 60)
    assert not routing_module.routes_and_aligns_in_one_launch(0, 128)
    monkeypatch.setattr(routing_module, "ROUTE_ALIGN_MAX_TOKENS", 16)
    assert routing_module.routes_and_aligns_in_one_launch(16, 128)
    assert not routing_module.routes_and_aligns_in_one_launch(17, 128)


@pytest.mark.parametrize("message,kwargs", [
    ("block_size", dict(block_size=0)),
    ("top_k", dict(top_k=9)),
    ("no tokens", dict(num_tokens=0)),
])
def test_bad_arguments_are_named(triton_device, message, kwargs):
    num_tokens = kwargs.pop("num_tokens", 2)
    args = dict(top_k=2, block_size=16) | kwargs
    logits = torch.randn(num_tokens, 8, device=triton_device)
    with pytest.raises(ValueError, match=message):
        route_topk_and_align_triton(logits, args["top_k"], True, torch.float32, args["block_size"])


def moe_inputs(device, num_tokens=5, num_experts=16, hidden=32, intermediate=24, top_k=4):
    hidden_states = torch.randn(num_tokens, hidden, device=device, dtype=torch.bfloat16)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, device=device, dtype=torch.bfloat16) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, intermediate, device=device, dtype=torch.bfloat16) / intermediate**0.5
    logits = torch.randn(num_tokens, num_experts, device=device, dtype=torch.bfloat16)
    return hidden_states, w13, w2, logits, top_k


@pytest.mark.parametrize("sum_experts", [True, False])
def test_fused_moe_with_the_layout_made_ahead_is_unchanged(triton_device, sum_experts):
    # exact: the same GEMM kernels over the same layout, only made in a different launch
    hidden, w13, w2, logits, top_k = moe_inputs(triton_device)
    block_size = kernels.moe_gemm_config(hidden.shape[0], w13, top_k).block_size_m
    weights, ids, alignment = kernels.route_topk_and_align(
        logits, top_k, True, torch.bfloat16, block_size=block_size
    )
    assert alignment is not None
    ahead = kernels.fused_moe(hidden, w13, w2, weights, ids, sum_experts=sum_experts, alignment=alignment)
    here = kernels.fused_moe(hidden, w13, w2, weights, ids, sum_experts=sum_experts)
    assert torch.equal(ahead, here)


def test_fused_moe_rejects_a_layout_for_other_blocks(triton_device):
    hidden, w13, w2, logits, top_k = moe_inputs(triton_device)
    block_size = kernels.moe_gemm_config(hidden.shape[0], w13, top_k).block_size_m
    weights, ids, alignment = route_topk_and_align_triton(logits, top_k, True, torch.bfloat16, block_size * 2)
    with pytest.raises(ValueError, match="alignment: made for GEMM blocks"):
        fused_moe_triton(hidden, w13, w2, weights, ids, alignment=alignment)
    _, _, other_tokens = route_topk_and_align_triton(logits[:2], top_k, True, torch.bfloat16, block_size)
    with pytest.raises(ValueError, match="alignment: sorted_token_ids has"):
        fused_moe_triton(hidden, w13, w2, weights, ids, alignment=other_tokens)


def test_fused_moe_rejects_a_layout_for_several_chunks(triton_device, monkeypatch):
    hidden, w13, w2, logits, top_k = moe_inputs(triton_device)
    block_size = kernels.moe_gemm_config(hidden.shape[0], w13, top_k).block_size_m
    weights, ids, alignment = route_topk_and_align_triton(logits, top_k, True, torch.bfloat16, block_size)
    monkeypatch.setattr(importlib.import_module("kernels.moe.fused_moe"), "MAX_TOKENS_PER_CHUNK", 2)
    with pytest.raises(ValueError, match="one chunk"):
        fused_moe_triton(hidden, w13, w2, weights, ids, alignment=alignment)


@pytest.mark.gpu
def test_gpu_route_topk_and_align_model_shapes(cuda_device):
    for num_tokens in (1, 8, 32):
        logits = torch.randn(num_tokens, 128, device=cuda_device)
        weights, ids, alignment = kernels.route_topk_and_align(logits, 8, True, torch.bfloat16, block_size=16)
        assert alignment is not None
        check_routing(weights, ids, logits, 8, True, torch.bfloat16)
        assert_alignment_matches_reference(alignment, ids, 128, 16)
