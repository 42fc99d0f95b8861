"""skinny_linear: a decode batch's dense projections (a few rows, 16-bit) in one kernel, against
F.linear."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.skinny_linear import SKINNY_MAX_ROWS, skinny_linear_triton
from tests.kernels.helpers import TOLERANCE, assert_close

skinny_module = importlib.import_module("kernels.skinny_linear")

CASES = [
    # (rows, K, N, dtype, bias)
    (1, 2048, 640, torch.bfloat16, False),  # one decode token at the hidden width: 8 steps of 256
    (3, 200, 70, torch.float16, True),  # neither K nor N a multiple of the tiles
    (8, 96, 48, torch.bfloat16, True),  # the largest batch the dispatcher gives the kernel
    (16, 64, 16, torch.bfloat16, False),  # every padded row used
]


def operands(rows, reduction, cols, dtype, bias, device):
    x = torch.randn(rows, reduction, device=device).to(dtype)
    weight = (torch.randn(cols, reduction, device=device) / reduction**0.5).to(dtype)
    return x, weight, (torch.randn(cols, device=device).to(dtype) if bias else None)


def expected(x, weight, bias):
    """F.linear in float32 of the same 16-bit operands, rounded once (as the kernel's float32 sums are)."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


@pytest.mark.parametrize("rows,reduction,cols,dtype,bias", [
    pytest.param(*case, id="M{}-K{}-N{}-{}{}".format(*case[:3], str(case[3]).removeprefix("torch."),
                                                       "-bias" if case[4] else "")) for case in CASES])
def test_the_kernel_equals_f_linear(triton_device, poison_allocations, rows, reduction, cols, dtype, bias):
    # tolerance: TOLERANCE[dtype] of max |expected| (float32 sums in another order, one rounding)
    x, weight, bias_tensor = operands(rows, reduction, cols, dtype, bias, triton_device)
    out = skinny_linear_triton(x, weight, bias_tensor)
    assert out.dtype == dtype
    assert_close(out, expected(x, weight, bias_tensor), rel=TOLERANCE[dtype])


@pytest.mark.parametrize("launch", [
    dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=2),
    dict(BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_N=16, BLOCK_K=512, num_warps=4, num_stages=3),
])
def test_other_launch_settings_compute_the_same(triton_device, launch):
    # the kernel rows' candidates (scripts/bench_kernels.py); tolerance as above
    x, weight, bias = operands(2, 300, 100, torch.bfloat16, True, triton_device)
    assert_close(skinny_linear_triton(x, weight, bias, launch=launch), expected(x, weight, bias),
                 rel=TOLERANCE[torch.bfloat16])


def test_strided_rows(triton_device):
    # the attention output reshaped, or a slice of a wider buffer: rows need only a unit last stride
    x, weight, _ = operands(2, 64, 32, torch.bfloat16, False, triton_device)
    wide = torch.zeros(2, 100, device=triton_device, dtype=torch.bfloat16)
    wide[:, 10:74] = x
    assert_close(skinny_linear_triton(wide[:, 10:74], weight), expected(x, weight, None),
                 rel=TOLERANCE[torch.bfloat16])


def test_the_dispatcher_takes_the_kernel_for_few_16_bit_rows_only(triton_device, monkeypatch):
    launches = []
    real = skinny_module.skinny_linear_triton
    monkeypatch.setattr(skinny_module, "skinny_linear_triton",
                        lambda *args: launches.append(args[0].shape[0]) or real(*args))
    _, weight, bias = operands(1, 32, 24, torch.bfloat16, True, triton_device)
    for rows in (1, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1):
        x = torch.randn(rows, 32, device=triton_device).to(torch.bfloat16)
        assert_close(kernels.skinny_linear(x, weight, bias), expected(x, weight, bias), rel=TOLERANCE[torch.bfloat16])
    x32 = torch.randn(1, 32, device=triton_device)
    torch.testing.assert_close(kernels.skinny_linear(x32, weight.float()), F.linear(x32, weight.float()))
    assert launches == [1, SKINNY_MAX_ROWS]  # past SKINNY_MAX_ROWS, and in float32: F.linear
    # operands the kernel's checks refuse go to F.linear too: columns of a transposed x or weight
    columns = torch.randn(32, 2, device=triton_device).to(torch.bfloat16).t()  # [2, 32], strides (1, 2)
    for args in ((columns, weight, bias), (x[:2], weight.t().contiguous().t(), bias)):
        assert_close(kernels.skinny_linear(*args), F.linear(*args), rel=TOLERANCE[torch.bfloat16])
    assert launches == [1, SKINNY_MAX_ROWS]
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "skinny_linear")
    kernels.skinny_linear(x[:1], weight, bias)
    monkeypatch.setenv("VLM_CATALOG_KERNELS", "reference")
    monkeypatch.delenv("VLM_CATALOG_KERNELS_OFF")
    kernels.skinny_linear(x[:1], weight, bias)
    assert launches == [1, SKINNY_MAX_ROWS]


@pytest.mark.parametrize("message,change", [
    ("x: 17 rows", dict(rows=17)),
    ("weight: expected shape", dict(reduction_of_weight=48)),
    ("weight: dtype torch.float16 is not supported", dict(weight_dtype=torch.float16)),
    ("x: dtype torch.float32 is not supported", dict(x_dtype=torch.float32)),
    ("bias: expected shape", dict(bias_cols=5)),
])
def test_bad_arguments_are_named(triton_device, message, change):
    x = torch.randn(change.get("rows", 2), 32, device=triton_device).to(change.get("x_dtype", torch.bfloat16))
    weight = torch.randn(24, change.get("reduction_of_weight", 32), device=triton_device).to(
        change.get("weight_dtype", torch.bfloat16))
    bias = torch.randn(change["bias_cols"], device=triton_device).to(torch.bfloat16) if "bias_cols" in change else None
    with pytest.raises(ValueError, match=message):
        skinny_linear_triton(x, weight, bias)


@pytest.mark.gpu
@pytest.mark.fast_path("skinny_linear")
def test_gpu_skinny_linear_model_shapes(cuda_device):
    # the 30B-A3B decode projections: q/k/v (2048 -> 5120) and o (4096 -> 2048), against cuBLAS
    for rows in (1, 4, 8):
        for reduction, cols in ((2048, 5120), (4096, 2048)):
            x, weight, _ = operands(rows, reduction, cols, torch.bfloat16, False, cuda_device)
            assert_close(kernels.skinny_linear(x, weight), F.linear(x, weight), rel=TOLERANCE[torch.bfloat16])
