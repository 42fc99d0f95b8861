"""A MoE layer's post-attention residual add, RMSNorm, router logits and routing, in one launch
for decode batches.

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

`add_rms_norm_route`, what the text model calls, also routes: the launch's last program to
finish (counted by `kernels/arrival_counters.py`) takes the top-k of every token's stored
logits and writes the expert-sorted layout for the MoE GEMMs, as `route_topk_and_align`'s
kernel would in a launch of its own (about 2.9 us and a gap at batch 1 on the H100).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.arrival_counters import arrival_counters
from kernels.checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_same_device,
    check_shape,
    check_unit_stride_last_dim,
)
from kernels.dispatch import kernels_off, use_triton
from kernels.fp8_input import Fp8Input, Fp8InputLayout
from kernels.launch_math import cdiv, next_power_of_2
from kernels.moe.align import MoeAlignment, empty_alignment, max_padded_pairs
from kernels.moe.routing import (
    MoeRouting,
    route_topk_and_align,
    route_topk_and_align_triton,
    routing_meta,
    routing_outputs,
)
from kernels.pdl import launch_options, weight_prefetch_meta
from kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_reference

NORM_ROUTER_MAX_TOKENS = 8  # the largest decode batch given the one launch
NORM_ROUTER_PROGRAMS = 64  # programs to aim for: each reads its share of the router weight
NORM_ROUTER_TILE = 8192  # float32 products one program holds: [BLOCK_T, BLOCK_E, BLOCK_H]
NORM_ROUTER_WARPS = 4
ROUTE_TILE = 8192  # the routing program's largest tile: [max(BLOCK_T, BLOCK_BLOCKS), BLOCK_EXPERTS]


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
    _check_args(x, residual, norm_weight, gate_weight)
    normed, new_residual, logits = _outputs(x, gate_weight)
    if x.shape[0]:
        _launch(x, residual, norm_weight, eps, gate_weight, normed, new_residual, logits)
    return normed, new_residual, logits


def add_rms_norm_route_triton(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor,
    top_k: int, renormalize: bool, weights_dtype: torch.dtype, block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, MoeRouting]:
    """`add_rms_norm_router_triton` whose last program to finish also routes every token and lays
    the pairs out for the MoE GEMMs' blocks of `block_size` rows: one launch for what
    `route_topk_and_align_triton` then did in a second. Where the counters cannot serve (a capture
    before the first eager call) or the tiles would not fit, those two launches."""
    _check_args(x, residual, norm_weight, gate_weight)
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")
    num_tokens = x.shape[0]
    num_experts = gate_weight.shape[0]
    if num_tokens == 0:
        raise ValueError("x: no tokens (routing lays out pairs only when there are some)")
    normed, new_residual, logits = _outputs(x, gate_weight)
    counter = arrival_counters(x.device, 1)
    tiles = route_tiles(num_tokens, num_experts, top_k, block_size)
    if counter is None or tiles is None:
        _launch(x, residual, norm_weight, eps, gate_weight, normed, new_residual, logits)
        return normed, new_residual, MoeRouting(*route_topk_and_align_triton(
            logits, top_k, renormalize, weights_dtype, block_size))
    weights, ids = routing_outputs(logits, top_k, weights_dtype)
    alignment = MoeAlignment(*empty_alignment(num_tokens * top_k, num_experts, block_size, x.device), block_size)
    routing = MoeRouting(weights, ids, alignment)
    _launch(x, residual, norm_weight, eps, gate_weight, normed, new_residual, logits, routing, counter,
            dict(routing_meta(top_k, num_experts, renormalize), **tiles))
    return normed, new_residual, routing


def route_tiles(num_tokens: int, num_experts: int, top_k: int, block_size: int) -> dict[str, int] | None:
    """BLOCK_PADDED and BLOCK_BLOCKS of the last program's layout (the most entries and blocks it
    can use), or None where its tiles ([BLOCK_T, BLOCK_EXPERTS] logits, [BLOCK_BLOCKS,
    BLOCK_EXPERTS] block owners) would pass `ROUTE_TILE`."""
    num_pairs = num_tokens * top_k
    used_entries = min(max_padded_pairs(num_pairs, num_experts, block_size), num_pairs * block_size)
    used_blocks = min(used_entries // block_size, num_pairs)  # every used block holds a pair
    block_experts = next_power_of_2(num_experts)
    if max(next_power_of_2(num_tokens), next_power_of_2(used_blocks)) * block_experts > ROUTE_TILE:
        return None
    return dict(BLOCK_PADDED=next_power_of_2(used_entries), BLOCK_BLOCKS=next_power_of_2(used_blocks))


def _outputs(x: torch.Tensor, gate_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised normed rows [T, H], new residual [T, H] and logits [T, E]."""
    num_tokens, hidden_size = x.shape
    normed = torch.empty((num_tokens, hidden_size), dtype=gate_weight.dtype, device=x.device)
    logits = torch.empty((num_tokens, gate_weight.shape[0]), dtype=gate_weight.dtype, device=x.device)
    return normed, torch.empty_like(x), logits


def _launch(x, residual, norm_weight, eps, gate_weight, normed, new_residual, logits,
            routing: MoeRouting | None = None, counter: torch.Tensor | None = None,
            route_meta: dict | None = None, prefetch_weight: bool | None = None) -> None:
    """The kernel; with `routing` (its outputs, uninitialised), `counter` and `route_meta` (the
    routing's meta-parameters and `route_tiles`), its last program routes and lays the pairs out;
    `prefetch_weight`: each program asks for its router rows and the norm weight into L2 before it
    waits for the grid before it (None: where the launch uses PDL, `kernels.pdl.weight_prefetch_meta`)."""
    from kernels.jit.norm_router import add_rms_norm_router_kernel

    num_tokens, hidden_size = x.shape
    num_experts = gate_weight.shape[0]
    meta = norm_router_launch(num_tokens, num_experts, hidden_size)
    options = launch_options(x)
    if routing is None:  # placeholders, never touched without ROUTE
        outputs = (logits,) * 6
        route_meta = dict(ROUTE=False, TOP_K=1, BLOCK_K=1, BLOCK_EXPERTS=1, RENORMALIZE=False, BLOCK_PADDED=1,
                          BLOCK_BLOCKS=1)
        block_size = 1
    else:
        alignment = routing.alignment
        outputs = (counter, routing.weights, routing.ids, alignment.sorted_token_ids, alignment.expert_ids,
                   alignment.num_tokens_post_padded)
        route_meta = dict(ROUTE=True, **route_meta)
        block_size = alignment.block_size
    add_rms_norm_router_kernel[(cdiv(num_experts, meta["BLOCK_E"]),)](
        # pointers
        x,
        residual,
        norm_weight,
        gate_weight,
        normed,
        new_residual,
        logits,
        *outputs,
        # sizes
        num_tokens,
        hidden_size,
        num_experts,
        eps,
        block_size,
        # strides
        x.stride(0),
        residual.stride(0),
        normed.stride(0),
        new_residual.stride(0),
        gate_weight.stride(0),
        logits.stride(0),
        # meta-parameters
        **meta,
        **route_meta,
        **weight_prefetch_meta(options, gate_weight, NORM_ROUTER_WARPS, meta["BLOCK_E"], prefetch_weight),
        num_warps=NORM_ROUTER_WARPS,
        **options,
    )


def norms_and_routes_in_one_launch(num_tokens: int) -> bool:
    """Whether `add_rms_norm_router` and `add_rms_norm_route` take the one launch (on the Triton path)."""
    return 0 < num_tokens <= NORM_ROUTER_MAX_TOKENS


def add_rms_norm_router(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor,
    quantize: Fp8InputLayout | None = None,
) -> tuple[torch.Tensor | Fp8Input, torch.Tensor, torch.Tensor]:
    """(x [T, H], residual [T, H]) -> (normed [T, H], new residual x + residual [T, H], router
    logits normed @ gate_weight.T [T, E]): in one launch on the Triton path for decode batches,
    else `fused_add_rms_norm` (which dispatches itself) and `F.linear`. `quantize`: the experts'
    FP8 input layout, which must keep the 16-bit rows (the router reads them); the normed rows
    then come as that input (`Fp8Input`) where the norm runs alone, as they are in the one launch."""
    if quantize is not None and not quantize.keep_unquantized:
        raise ValueError("quantize: the router reads the normed 16-bit rows, so the layout must keep them")
    one_launch = x.dim() == 2 and norms_and_routes_in_one_launch(x.shape[0])
    if one_launch and use_triton(x, residual, norm_weight, gate_weight, op="add_rms_norm_router"):
        return add_rms_norm_router_triton(x, residual, norm_weight, eps, gate_weight)
    normed, new_residual = fused_add_rms_norm(x, residual, norm_weight, eps, quantize)
    return normed, new_residual, F.linear(normed if quantize is None else normed.unquantized, gate_weight)


def add_rms_norm_route(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor,
    top_k: int, renormalize: bool = True, weights_dtype: torch.dtype | None = None, *, block_size: int,
    quantize: Fp8InputLayout | None = None,
) -> tuple[torch.Tensor | Fp8Input, torch.Tensor, MoeRouting]:
    """`add_rms_norm_router`, then the routing `route_topk_and_align` makes of its logits (weights
    in `weights_dtype`, default the router's dtype; the layout for GEMM blocks of `block_size`
    rows, or None): in one launch on the Triton path for decode batches, unless
    ``norm_router_routes`` is in VLM_CATALOG_KERNELS_OFF (then a second launch routes).
    `quantize` as `add_rms_norm_router` takes it."""
    weights_dtype = weights_dtype or gate_weight.dtype
    one_launch = x.dim() == 2 and norms_and_routes_in_one_launch(x.shape[0])
    if (one_launch and "norm_router_routes" not in kernels_off()
            and use_triton(x, residual, norm_weight, gate_weight, op="add_rms_norm_router")):
        return add_rms_norm_route_triton(x, residual, norm_weight, eps, gate_weight, top_k, renormalize,
                                         weights_dtype, block_size)
    normed, new_residual, logits = add_rms_norm_router(x, residual, norm_weight, eps, gate_weight, quantize)
    return normed, new_residual, MoeRouting(*route_topk_and_align(logits, top_k, renormalize, weights_dtype,
                                                                  block_size=block_size))
