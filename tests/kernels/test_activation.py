"""silu_and_mul: reference vs transformers' MLP arithmetic and float64, Triton vs reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.activation import silu_and_mul_reference, silu_and_mul_triton
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


@pytest.mark.gpu
def test_gpu_silu_and_mul(cuda_device):
    x = torch.randn(8192, 2 * 6144, device=cuda_device, dtype=torch.bfloat16)
    assert_close(kernels.silu_and_mul(x), silu_and_mul_reference(x), rel=1e-2)
