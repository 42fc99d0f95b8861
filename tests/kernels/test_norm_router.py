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
def test_gpu_add_rms_norm_router_model_shapes(cuda_device):
    for num_tokens in (1, 4, 8):
        args = inputs(num_tokens, 2048, 128, torch.bfloat16, cuda_device)
        check(kernels.add_rms_norm_router(*args[:3], 1e-6, args[3]), *args)
