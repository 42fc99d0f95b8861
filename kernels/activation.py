"""SiLU-and-multiply: x [T, 2I] -> silu(x[:, :I]) * x[:, I:] [T, I].

Matches transformers' dense MLP / expert arithmetic ``act_fn(gate) * up`` with
gate and up already in the activation dtype: silu's result is rounded to that
dtype before the multiply.

`silu_and_mul_quantize` writes that product as FP8 (e4m3) with one scale per token
instead (`kernels.fp8.quantize_activations` of it, in one pass): the input of a
per-channel W8A8 down projection (kernels/moe/grouped_gemm.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.checks import FLOAT_DTYPES, check_dtype, check_unit_stride_last_dim
from kernels.dispatch import use_triton
from kernels.fp8 import FP8_DTYPE, quantize_activations_reference
from kernels.launch_math import cdiv, next_power_of_2
from kernels.pdl import launch_options


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def silu_and_mul_quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 2I] -> (e4m3 [T, I], float32 scale [T, 1]): `silu_and_mul_reference`, then quantized
    per token."""
    activated = silu_and_mul_reference(x)
    return quantize_activations_reference(activated, activated.shape[-1])


def _check_gate_up(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x: expected shape [T, 2I], got {tuple(x.shape)}")
    if x.shape[1] % 2:
        raise ValueError(f"x: last dimension must be even (gate and up halves), got {x.shape[1]}")
    check_dtype("x", x, FLOAT_DTYPES)
    check_unit_stride_last_dim("x", x)


def silu_and_mul_quantize_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels.jit.activation import silu_and_mul_quantize_kernel

    _check_gate_up(x)
    num_tokens, intermediate = x.shape[0], x.shape[1] // 2
    quantized = torch.empty((num_tokens, intermediate), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((num_tokens, 1), dtype=torch.float32, device=x.device)
    if num_tokens == 0 or intermediate == 0:
        return quantized, scale
    block_size = next_power_of_2(intermediate)
    silu_and_mul_quantize_kernel[(num_tokens,)](
        # pointers
        x,
        quantized,
        scale,
        # sizes
        intermediate,
        # strides
        x.stride(0),
        quantized.stride(0),
        # meta-parameters
        BLOCK_SIZE=block_size,
        num_warps=min(max(block_size // 256, 1), 8),
        **launch_options(x),
    )
    return quantized, scale


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    from kernels.jit.activation import silu_and_mul_kernel

    _check_gate_up(x)
    num_tokens, intermediate = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, intermediate), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or intermediate == 0:
        return out
    block_size = min(next_power_of_2(intermediate), 1024)
    grid = (num_tokens, cdiv(intermediate, block_size))
    silu_and_mul_kernel[grid](
        # pointers
        x,
        out,
        # sizes
        intermediate,
        # strides
        x.stride(0),
        out.stride(0),
        # meta-parameters
        BLOCK_SIZE=block_size,
        num_warps=4,
        **launch_options(x),
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> [T, I]."""
    if use_triton(x, op="silu_and_mul"):
        return silu_and_mul_triton(x)
    return silu_and_mul_reference(x)


def silu_and_mul_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 2I] -> (silu(gate) * up as e4m3 [T, I], one float32 scale per token [T, 1])."""
    if use_triton(x, op="silu_and_mul"):
        return silu_and_mul_quantize_triton(x)
    return silu_and_mul_quantize_reference(x)
