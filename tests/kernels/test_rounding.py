"""`round_through` (kernels/jit/rounding.py) against torch's conversions, bit for bit.

The fused MoE's epilogues round each GEMM result to the activation dtype with it, so
that the kernels keep the torch reference's rounding points. Reference: torch's
float32 -> bfloat16 / float16 conversion (round to nearest, ties to even), widened back.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
rounding = pytest.importorskip("kernels.jit.rounding")

BLOCK = 65536


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, rounding.round_through(x, DTYPE), mask=mask)


TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def round_through(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, out, x.numel(), DTYPE=TRITON_DTYPES[dtype], BLOCK=BLOCK)
    return out


def test_every_bfloat16_rounding_case_matches_torch_bit_for_bit():
    # every upper half (each bfloat16 value: zeros, subnormals, normals, the largest finite,
    # infinities, NaNs), with the low halves that decide the rounding: none, just under half,
    # exactly half (a tie: to even), just over half, all ones (carries into the exponent)
    upper = torch.arange(1 << 16, dtype=torch.int64) << 16
    lower = torch.tensor([0x0000, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    bits = (upper[:, None] | lower[None, :]).reshape(-1)
    x = bits.to(torch.int32).view(torch.float32)  # int64 -> int32 wraps the sign bit into place
    expected = x.to(torch.bfloat16).to(torch.float32)
    rounded = round_through(x, torch.bfloat16)
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(rounded), nan)  # a NaN stays a NaN, whatever its payload
    assert nan.sum() > 0 and torch.isinf(expected).sum() > 0  # the cases are in the set
    assert torch.equal(rounded[~nan].view(torch.int32), expected[~nan].view(torch.int32))  # -0 and ties too


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # float16: to inf, as torch
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_random_values_round_as_the_conversion_does(dtype):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * torch.logspace(-8, 8, 4096)
    assert torch.equal(round_through(x, dtype), x.to(dtype).to(torch.float32))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # past 65504: to inf, as torch
def test_every_float16_value_and_rounding_case_matches_torch_bit_for_bit():
    # every float16 value (subnormals, infinities and NaNs included) as a float32 input, and
    # float32 values between float16 neighbours, ties among them, past the largest finite and
    # under the smallest subnormal
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).to(torch.float32)
    steps = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]) * 2.0**-10  # fractions of a float16 unit, relative
    x = torch.cat([values, (values[:, None] * (1 + steps[None, :])).reshape(-1),
                   torch.tensor([65519.0, 65520.0, 7e4, 2.0**-25, 2.0**-25 * 1.5, 2.0**-26, -2.0**-25])])
    expected = x.to(torch.float16).to(torch.float32)
    rounded = round_through(x, torch.float16)
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(rounded), nan)
    assert nan.sum() > 0 and torch.isinf(expected).sum() > 0 and (expected.abs() < 2.0**-14).sum() > 2000
    assert torch.equal(rounded[~nan].view(torch.int32), expected[~nan].view(torch.int32))
