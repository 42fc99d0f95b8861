"""A MoE layer's post-attention residual add, RMSNorm and router logits, in one launch for
decode batches.

A decode layer at batch 1 is latency-bound outside its weight reads: the add-and-norm
(`fused_add_rms_norm`) and the router's GEMM (`F.linear` with a 128 x 2048 weight, 0.5 MB)
were two launches of about 2.5 and 4.9 us on the H100 of 2026-11-28, for work the copy
bandwidth does in under 0.2 us. Here one launch does both: each of its programs norms
every token's row itself and computes the logits of a few experts
(kernels/jit/norm_router.py). Up to `NORM_ROUTER_MAX_TOKENS` tokens (every program reads every
row twice, so larger batches keep the two launches, whose norm reads each row once).

The result equals the two ops it replaces: the normed rows and the new residual exactly
(the same arithmetic as `rms_norm_kernel`), the logits up to the order of a float32 sum
(each rounded once to the hidden dtype, as a 16-bit `F.linear` rounds its output).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_same_device,
    check_shape,
    check_unit_stride_last_dim,
)
from kernels.dispatch import use_triton
from kernels.launch_math import cdiv, next_power_of_2
from kernels.pdl import launch_options
from kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_reference

NORM_ROUTER_MAX_TOKENS = 8  # the largest decode batch given the one launch
NORM_ROUTER_PROGRAMS = 64  # programs to aim for: each reads its share of the router weight
NORM_ROUTER_TILE = 8192  # float32 products one program holds: [BLOCK_T, BLOCK_E, BLOCK_H]


def add_rms_norm_router_reference(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normed, x + residual, router logits): `fused_add_rms_norm_reference`, then `F.linear`."""
    normed, new_residual = fused_add_rms_norm_reference(x, residual, norm_weight, eps)
    return normed, new_residual, F.linear(normed, gate_weight)


def norm_router_launch(num_tokens: int, num_experts: int, hidden_size: int) -> dict[str, int]:
    """BLOCK_T, BLOCK_E and BLOCK_H of the kernel for these sizes: about `NORM_ROUTER_PROGRAMS`
    programs, and BLOCK_H as wide as the tile allows (the whole row at batch 1 and 30B-A3B)."""
    block_t = next_power_of_2(num_tokens)
    block_e = max(1, next_power_of_2(num_experts) // NORM_ROUTER_PROGRAMS)
    block_h = max(16, min(next_power_of_2(hidden_size), NORM_ROUTER_TILE // (block_t * block_e)))
    return dict(BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_H=block_h)


def _check_args(x, residual, norm_weight, gate_weight) -> None:
    check_shape("x", x, (None, None))
    num_tokens, hidden_size = x.shape
    check_shape("residual", residual, (num_tokens, hidden_size))
    check_shape("norm_weight", norm_weight, (hidden_size,))
    check_shape("gate_weight", gate_weight, (None, hidden_size))
    for name, tensor in (("x", x), ("residual", residual), ("norm_weight", norm_weight), ("gate_weight", gate_weight)):
        check_dtype(name, tensor, FLOAT_DTYPES)
        check_unit_stride_last_dim(name, tensor)
    check_same_device(x=x, residual=residual, norm_weight=norm_weight, gate_weight=gate_weight)
    normed_dtype = torch.promote_types(norm_weight.dtype, x.dtype)
    if gate_weight.dtype != normed_dtype:
        raise ValueError(f"gate_weight: dtype {gate_weight.dtype} differs from the normed rows' {normed_dtype} "
                         "(F.linear takes one dtype)")


def add_rms_norm_router_triton(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch, whatever the batch (callers keep it to `NORM_ROUTER_MAX_TOKENS` tokens)."""
    from kernels.jit.norm_router import add_rms_norm_router_kernel

    _check_args(x, residual, norm_weight, gate_weight)
    num_tokens, hidden_size = x.shape
    num_experts = gate_weight.shape[0]
    normed = torch.empty((num_tokens, hidden_size), dtype=gate_weight.dtype, device=x.device)
    new_residual = torch.empty_like(x)
    logits = torch.empty((num_tokens, num_experts), dtype=gate_weight.dtype, device=x.device)
    if num_tokens == 0:
        return normed, new_residual, logits
    meta = norm_router_launch(num_tokens, num_experts, hidden_size)
    add_rms_norm_router_kernel[(cdiv(num_experts, meta["BLOCK_E"]),)](
        # pointers
        x,
        residual,
        norm_weight,
        gate_weight,
        normed,
        new_residual,
        logits,
        # sizes
        num_tokens,
        hidden_size,
        num_experts,
        eps,
        # strides
        x.stride(0),
        residual.stride(0),
        normed.stride(0),
        new_residual.stride(0),
        gate_weight.stride(0),
        logits.stride(0),
        # meta-parameters
        **meta,
        num_warps=4,
        **launch_options(x),
    )
    return normed, new_residual, logits


def norms_and_routes_in_one_launch(num_tokens: int) -> bool:
    """Whether `add_rms_norm_router` takes the one launch (on the Triton path)."""
    return 0 < num_tokens <= NORM_ROUTER_MAX_TOKENS


def add_rms_norm_router(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [T, H], residual [T, H]) -> (normed [T, H], new residual x + residual [T, H], router
    logits normed @ gate_weight.T [T, E]): in one launch on the Triton path for decode batches,
    else `fused_add_rms_norm` (which dispatches itself) and `F.linear`."""
    one_launch = x.dim() == 2 and norms_and_routes_in_one_launch(x.shape[0])
    if one_launch and use_triton(x, residual, norm_weight, gate_weight, op="add_rms_norm_router"):
        return add_rms_norm_router_triton(x, residual, norm_weight, eps, gate_weight)
    normed, new_residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    return normed, new_residual, F.linear(normed, gate_weight)
