"""SiLU-and-multiply: x [T, 2I] -> silu(x[:, :I]) * x[:, I:] [T, I].

Matches transformers' dense MLP / expert arithmetic ``act_fn(gate) * up`` with
gate and up already in the activation dtype: silu's result is rounded to that
dtype before the multiply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.checks import FLOAT_DTYPES, check_dtype, check_unit_stride_last_dim
from kernels.dispatch import use_triton


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    import triton

    from kernels.jit.activation import silu_and_mul_kernel

    if x.dim() != 2:
        raise ValueError(f"x: expected shape [T, 2I], got {tuple(x.shape)}")
    if x.shape[1] % 2:
        raise ValueError(f"x: last dimension must be even (gate and up halves), got {x.shape[1]}")
    check_dtype("x", x, FLOAT_DTYPES)
    check_unit_stride_last_dim("x", x)
    num_tokens, intermediate = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, intermediate), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or intermediate == 0:
        return out
    block_size = min(triton.next_power_of_2(intermediate), 1024)
    grid = (num_tokens, triton.cdiv(intermediate, block_size))
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
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> [T, I]."""
    if use_triton(x, op="silu_and_mul"):
        return silu_and_mul_triton(x)
    return silu_and_mul_reference(x)
