"""silu_and_mul: reference vs transformers' MLP arithmetic and float64, Triton vs reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.activation import (
    silu_and_mul_quantize,
    silu_and_mul_quantize_reference,
    silu_and_mul_quantize_triton,
    silu_and_mul_reference,
    silu_and_mul_triton,
)
from kernels.fp8 import FP8_DTYPE, dequantize_activations
from tests.kernels.helpers import TOLERANCE, assert_close


def test_reference_is_act_gate_times_up_bitwise():
    x = torch.randn(5, 2 * 24, dtype=torch.bfloat16)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul_reference(x), F.silu(gate) * up, rtol=0, atol=0)


def test_reference_against_float64():
    # tolerance: 1e-6 relative (float32)
    x = torch.randn(7, 2 * 33) * 4
    gate, up = x.double()[:, :33], x.double()[:, 33:]
    assert_close(silu_and_mul_reference(x), gate / (1 + torch.exp(-gate)) * up, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens,intermediate", [(1, 1), (6, 37), (3, 768), (2, 1500)])
def test_triton_silu_and_mul(triton_device, poison_allocations, dtype, num_tokens, intermediate):
    # tolerance: TOLERANCE[dtype] (float32 1e-4, 16-bit 1e-2)
    x = (torch.randn(num_tokens, 2 * intermediate) * 3).to(dtype).to(triton_device)
    out = kernels.silu_and_mul(x)
    assert out.shape == (num_tokens, intermediate) and out.dtype == dtype
    assert_close(out, silu_and_mul_reference(x), rel=TOLERANCE[dtype])


def test_triton_rejects_odd_width(triton_device):
    with pytest.raises(ValueError, match="even"):
        silu_and_mul_triton(torch.randn(2, 7, device=triton_device))


def assert_quantized_close(got, expected, intermediate):
    """Scales equal to float32 rounding; dequantized values within one e4m3 step (2^-3 relative)
    of the reference's, plus the smallest step at this scale (values rounding near zero)."""
    (quantized, scale), (expected_quantized, expected_scale) = got, expected
    assert quantized.dtype == FP8_DTYPE and scale.shape == expected_scale.shape == (quantized.shape[0], 1)
    torch.testing.assert_close(scale.cpu(), expected_scale.cpu(), rtol=1e-6, atol=0)
    values, expected_values = (dequantize_activations(q.cpu(), s.cpu(), intermediate)
                               for q, s in ((quantized, scale), (expected_quantized, expected_scale)))
    step = expected_scale.cpu() * 2.0**-9  # e4m3's smallest subnormal, at each row's scale
    assert bool(((values - expected_values).abs() <= expected_values.abs() * 2.0**-3 + step).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,intermediate", [(1, 16), (5, 37), (3, 768)])
def test_triton_silu_and_mul_quantize(triton_device, poison_allocations, dtype, num_tokens, intermediate):
    # one pass: the product silu_and_mul writes, quantized per token as quantize_activations does
    x = (torch.randn(num_tokens, 2 * intermediate) * 3).to(dtype)
    x[0, :] = 0.0  # an all-zero row: scale 1, zeros
    x = x.to(triton_device)
    got = silu_and_mul_quantize_triton(x)
    assert_quantized_close(got, silu_and_mul_quantize_reference(x), intermediate)
    assert float(got[1][0]) == 1.0 and not bool(got[0][0].float().any())


def test_triton_silu_and_mul_quantize_rejects_bad_input(triton_device):
    with pytest.raises(ValueError, match="even"):
        silu_and_mul_quantize_triton(torch.randn(2, 7, device=triton_device))
    with pytest.raises(ValueError, match="x"):
        silu_and_mul_quantize_triton(torch.randn(2, 3, 8, device=triton_device))


@pytest.mark.gpu
def test_gpu_silu_and_mul_quantize(cuda_device):
    # the grouped-GEMM MoE's down input at 30B-A3B: 16k tokens x 8 experts, I = 768
    x = torch.randn(131072, 2 * 768, device=cuda_device, dtype=torch.bfloat16)
    assert_quantized_close(silu_and_mul_quantize(x), silu_and_mul_quantize_reference(x), 768)


@pytest.mark.gpu
def test_gpu_silu_and_mul(cuda_device):
    x = torch.randn(8192, 2 * 6144, device=cuda_device, dtype=torch.bfloat16)
    assert_close(kernels.silu_and_mul(x), silu_and_mul_reference(x), rel=1e-2)
