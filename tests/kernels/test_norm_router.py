"""add_rms_norm_router: a MoE layer's post-attention add, RMSNorm and router logits in one launch
(decode batches), against the two ops it replaces."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.norm_router import (
    add_rms_norm_router_reference,
    add_rms_norm_router_triton,
    norm_router_launch,
)
from tests.kernels.helpers import TOLERANCE, assert_close

norm_router_module = importlib.import_module("kernels.norm_router")

CASES = [
    # (T, H, E, dtype)
    (1, 2048, 128, torch.bfloat16),  # one decode token at the 30B-A3B shapes: the whole row per step, 64 programs
    (8, 2048, 128, torch.bfloat16),  # the largest batch the dispatcher gives the kernel: 4 steps of 512 columns
    (3, 200, 60, torch.float32),  # neither H nor E a power of two; E not a multiple of the programs' experts
    (5, 96, 6, torch.float16),
]


def inputs(num_tokens, hidden_size, num_experts, dtype, device):
    x = torch.randn(num_tokens, hidden_size, device=device).to(dtype)
    residual = (4 * torch.randn(num_tokens, hidden_size, device=device)).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(hidden_size, device=device)).to(dtype)
    gate_weight = (torch.randn(num_experts, hidden_size, device=device) / hidden_size**0.5).to(dtype)
    return x, residual, norm_weight, gate_weight


def check(got, x, residual, norm_weight, gate_weight, eps=1e-6):
    # tolerance: the new residual exactly (one rounding of the same sum); the normed rows and the
    # logits to TOLERANCE[dtype] of max |expected| (float32 sums in another order: the mean square
    # in chunks, the logits in the kernel's products against F.linear's GEMM)
    normed, new_residual, logits = got
    expected = add_rms_norm_router_reference(x, residual, norm_weight, eps, gate_weight)
    dtype = x.dtype
    assert normed.dtype == new_residual.dtype == logits.dtype == dtype
    assert torch.equal(new_residual, expected[1])
    assert_close(normed, expected[0], rel=TOLERANCE[dtype], what="normed")
    assert_close(logits, expected[2], rel=TOLERANCE[dtype], what="logits")
    # and the logits of the rows the kernel normed, to float32 rounding of the same products
    assert_close(logits, F.linear(normed.float(), gate_weight.float()).to(dtype), rel=TOLERANCE[dtype],
                 what="logits of the kernel's normed rows")


@pytest.mark.parametrize("num_tokens,hidden_size,num_experts,dtype", [
    pytest.param(*case, id="T{}-H{}-E{}-{}".format(*case[:3], str(case[3]).removeprefix("torch."))) for case in CASES])
def test_one_launch_equals_add_norm_then_router(triton_device, poison_allocations, num_tokens, hidden_size,
                                                num_experts, dtype):
    # every output starts poisoned (NaN), so an entry no program writes shows
    args = inputs(num_tokens, hidden_size, num_experts, dtype, triton_device)
    check(add_rms_norm_router_triton(*args[:3], 1e-6, args[3]), *args)


def test_strided_rows(triton_device):
    # the attention output and the residual may be views with a row stride wider than H
    x, residual, norm_weight, gate_weight = inputs(4, 96, 16, torch.float32, triton_device)
    wide_x = torch.randn(4, 160, device=triton_device)
    wide_x[:, 32:128] = x
    wide_gate = torch.randn(16, 100, device=triton_device)
    wide_gate[:, :96] = gate_weight
    got = add_rms_norm_router_triton(wide_x[:, 32:128], residual, norm_weight, 1e-6, wide_gate[:, :96])
    check(got, x, residual, norm_weight, gate_weight)


def test_the_launch_aims_for_64_programs_within_the_tile():
    # 128 experts: two per program; 60 (64 in the powers of two): one each; the float32 products
    # a program holds, [BLOCK_T, BLOCK_E, BLOCK_H], stay within NORM_ROUTER_TILE
    assert norm_router_launch(1, 128, 2048) == dict(BLOCK_T=1, BLOCK_E=2, BLOCK_H=2048)
    assert norm_router_launch(8, 128, 2048) == dict(BLOCK_T=8, BLOCK_E=2, BLOCK_H=512)
    assert norm_router_launch(3, 60, 200) == dict(BLOCK_T=4, BLOCK_E=1, BLOCK_H=256)
    assert norm_router_launch(8, 512, 4096) == dict(BLOCK_T=8, BLOCK_E=8, BLOCK_H=128)


def test_the_dispatcher_keeps_the_two_ops_past_decode_batches(triton_device, monkeypatch):
    launches = []
    real = norm_router_module.add_rms_norm_router_triton
    monkeypatch.setattr(norm_router_module, "add_rms_norm_router_triton",
                        lambda *args: launches.append(args[0].shape[0]) or real(*args))
    largest = norm_router_module.NORM_ROUTER_MAX_TOKENS
    for num_tokens in (1, largest, largest + 1):
        args = inputs(num_tokens, 64, 8, torch.float32, triton_device)
        check(kernels.add_rms_norm_router(*args[:3], 1e-6, args[3]), *args)
    assert launches == [1, largest]  # past NORM_ROUTER_MAX_TOKENS: fused_add_rms_norm, then F.linear
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "add_rms_norm_router")
    args = inputs(2, 64, 8, torch.float32, triton_device)
    check(kernels.add_rms_norm_router(*args[:3], 1e-6, args[3]), *args)
    monkeypatch.setenv("VLM_CATALOG_KERNELS", "reference")
    check(kernels.add_rms_norm_router(*args[:3], 1e-6, args[3]), *args)
    assert launches == [1, largest]


@pytest.mark.parametrize("message,change", [
    ("residual: expected shape", dict(residual=(3, 64))),
    ("norm_weight: expected shape", dict(norm_weight=(32,))),
    ("gate_weight: expected shape", dict(gate_weight=(8, 32))),
    ("gate_weight: dtype torch.float16 differs", dict(gate_dtype=torch.float16)),
    ("x: expected 2 dimensions", dict(x=(2, 1, 64))),
])
def test_bad_arguments_are_named(triton_device, message, change):
    x, residual, norm_weight, gate_weight = inputs(2, 64, 8, torch.float32, triton_device)
    if "x" in change:
        x = torch.randn(*change["x"], device=triton_device)
    if "residual" in change:
        residual = torch.randn(*change["residual"], device=triton_device)
    if "norm_weight" in change:
        norm_weight = torch.randn(*change["norm_weight"], device=triton_device)
    if "gate_weight" in change:
        gate_weight = torch.randn(*change["gate_weight"], device=triton_device)
    if "gate_dtype" in change:
        gate_weight = gate_weight.to(change["gate_dtype"])
    with pytest.raises(ValueError, match=message):
        add_rms_norm_router_triton(x, residual, norm_weight, 1e-6, gate_weight)


@pytest.mark.gpu
@pytest.mark.fast_path("add_rms_norm_router")
def test_gpu_add_rms_norm_router_model_shapes(cuda_device):
    for num_tokens in (1, 4, 8):
        args = inputs(num_tokens, 2048, 128, torch.bfloat16, cuda_device)
        check(kernels.add_rms_norm_router(*args[:3], 1e-6, args[3]), *args)


ROUTE_CASES = [
    # (T, H, E, K, block size, dtype)
    (1, 2048, 128, 8, 16, torch.bfloat16),  # one decode token at the 30B-A3B shapes
    (8, 256, 128, 8, 16, torch.bfloat16),  # the largest batch the dispatcher gives the kernel
    (5, 96, 60, 4, 16, torch.float32),  # neither T nor E a power of two
    (3, 32, 6, 6, 4, torch.float32),  # every token picks every expert, expert 0 included
    (7, 64, 9, 3, 1, torch.bfloat16),  # blocks of one row
]


@pytest.mark.parametrize("num_tokens,hidden_size,num_experts,top_k,block_size,dtype", [
    pytest.param(*case, id="T{}-H{}-E{}-K{}-block{}".format(*case[:5])) for case in ROUTE_CASES])
def test_the_last_program_routes_and_lays_the_pairs_out(triton_device, poison_allocations, num_tokens, hidden_size,
                                                       num_experts, top_k, block_size, dtype):
    """add_rms_norm_route in one launch: the normed rows and residual of the norm-and-router launch,
    and the routing route_topk_and_align's kernel makes of its logits (top-k, renormalized,
    weights in the hidden dtype, ties to the lower expert id) with the align layout; twice, the
    counter back at zero after each."""
    # exact: the same logits (add_rms_norm_router_triton, the same arithmetic) routed by the same
    # helper; in float32 also against torch's top-k (no ties there)
    from kernels.arrival_counters import arrival_counters
    from kernels.moe.routing import route_topk_and_align_triton
    from kernels.norm_router import add_rms_norm_route_triton
    from tests.kernels.moe_layout import assert_alignment_matches_reference
    from tests.kernels.test_moe_route_align import check_routing

    args = inputs(num_tokens, hidden_size, num_experts, dtype, triton_device)
    normed, new_residual, logits = add_rms_norm_router_triton(*args[:3], 1e-6, args[3])
    weights, ids, _ = route_topk_and_align_triton(logits, top_k, True, dtype, block_size)
    for _ in range(2):
        got_normed, got_residual, routing = add_rms_norm_route_triton(*args[:3], 1e-6, args[3], top_k, True, dtype,
                                                                      block_size)
        assert torch.equal(got_normed, normed) and torch.equal(got_residual, new_residual)
        assert torch.equal(routing.ids, ids) and torch.equal(routing.weights, weights)
        if dtype == torch.float32:
            check_routing(routing.weights, routing.ids, logits, top_k, True, dtype)
        assert routing.alignment.block_size == block_size
        assert_alignment_matches_reference(routing.alignment, routing.ids, num_experts, block_size)
        assert int(arrival_counters(triton_device, 1).abs().sum()) == 0


def test_routing_too_wide_for_the_last_program_takes_a_second_launch(triton_device, monkeypatch):
    # 1024 experts at 8 tokens: [64 blocks, 1024 experts] would pass ROUTE_TILE; run here with the
    # tile shrunk so that 16 experts pass it ([32 blocks, 16 experts])
    from kernels.norm_router import add_rms_norm_route_triton, route_tiles
    from tests.kernels.moe_layout import assert_alignment_matches_reference
    from tests.kernels.test_moe_route_align import check_routing

    assert route_tiles(8, 1024, 8, 16) is None and route_tiles(8, 128, 8, 16) == dict(BLOCK_PADDED=1024, BLOCK_BLOCKS=64)
    monkeypatch.setattr(norm_router_module, "ROUTE_TILE", 256)
    assert route_tiles(8, 16, 4, 16) is None
    second_launches = []
    real = norm_router_module.route_topk_and_align_triton
    monkeypatch.setattr(norm_router_module, "route_topk_and_align_triton",
                        lambda logits, *a: second_launches.append(logits.shape) or real(logits, *a))
    args = inputs(8, 64, 16, torch.float32, triton_device)
    normed, _, logits = add_rms_norm_router_triton(*args[:3], 1e-6, args[3])
    got_normed, _, routing = add_rms_norm_route_triton(*args[:3], 1e-6, args[3], 4, True, torch.float32, 16)
    assert torch.equal(got_normed, normed) and second_launches == [(8, 16)]
    check_routing(routing.weights, routing.ids, logits, 4, True, torch.float32)
    assert_alignment_matches_reference(routing.alignment, routing.ids, 16, 16)


def test_the_route_dispatcher(triton_device, monkeypatch):
    """One launch up to NORM_ROUTER_MAX_TOKENS tokens; past them, with `norm_router_routes` off or on
    the reference path, the norm-and-router op and then route_topk_and_align, whose routing is
    the same."""
    routing_module = importlib.import_module("kernels.moe.routing")
    second_launches = []
    real = routing_module.route_topk_and_align
    monkeypatch.setattr(norm_router_module, "route_topk_and_align",
                        lambda logits, *a, **k: second_launches.append(logits.shape[0]) or real(logits, *a, **k))
    largest = norm_router_module.NORM_ROUTER_MAX_TOKENS
    results = {}
    for num_tokens in (2, largest + 1):
        args = inputs(num_tokens, 64, 16, torch.float32, triton_device)
        results[num_tokens] = (args, kernels.add_rms_norm_route(*args[:3], 1e-6, args[3], 4, block_size=16))
    assert second_launches == [largest + 1]
    args, (normed, new_residual, routing) = results[2]
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "norm_router_routes")
    _, _, two_launches = kernels.add_rms_norm_route(*args[:3], 1e-6, args[3], 4, block_size=16)
    assert second_launches == [largest + 1, 2]
    assert torch.equal(two_launches.ids, routing.ids) and torch.equal(two_launches.weights, routing.weights)
    monkeypatch.setenv("VLM_CATALOG_KERNELS", "reference")
    monkeypatch.delenv("VLM_CATALOG_KERNELS_OFF")
    _, _, reference = kernels.add_rms_norm_route(*args[:3], 1e-6, args[3], 4, block_size=16)
    assert reference.alignment is None  # the reference path leaves the layout to fused_moe
    assert torch.equal(reference.ids, routing.ids)


@pytest.mark.gpu
@pytest.mark.fast_path("norm_router_routes")
def test_gpu_add_rms_norm_route_model_shapes(cuda_device):
    # many programs finishing in any order: the last one's routing, every launch the same
    from kernels.moe.routing import route_topk_and_align_triton
    from tests.kernels.moe_layout import assert_alignment_matches_reference

    for num_tokens in (1, 4, 8):
        args = inputs(num_tokens, 2048, 128, torch.bfloat16, cuda_device)
        _, _, logits = kernels.add_rms_norm_router(*args[:3], 1e-6, args[3])
        weights, ids, _ = route_topk_and_align_triton(logits, 8, True, torch.bfloat16, 16)
        first = None
        for _ in range(20):
            _, _, routing = kernels.add_rms_norm_route(*args[:3], 1e-6, args[3], 8, block_size=16)
            # the ids exactly, the weights to a bf16 step: the routing kernel sums each row's softmax
            # with two rows per warp, the fused launch with a row per program on 4 warps
            assert torch.equal(routing.ids, ids)
            torch.testing.assert_close(routing.weights.float(), weights.float(),
                                       rtol=torch.finfo(torch.bfloat16).eps, atol=0)
            assert_alignment_matches_reference(routing.alignment, routing.ids, 128, 16)
            first = first or routing
            assert torch.equal(routing.weights, first.weights)  # whichever program routes: the same bits
            assert torch.equal(routing.alignment.sorted_token_ids, first.alignment.sorted_token_ids)
