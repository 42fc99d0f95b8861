"""Top-k expert routing: softmax over experts in float32, keep the k largest.

As transformers' `Qwen3VLMoeTextTopKRouter`: ``softmax(logits, float32)``,
``torch.topk``, then divide by the sum of the kept weights (the model always
renormalises; the flag is kept for other checkpoints). The weights are computed
in float32; transformers then casts them to the hidden dtype for the experts,
which `weights_dtype` does at the store (one launch fewer per MoE layer).

`route_topk_and_align` also lays the (token, k) pairs out by expert for the
fused MoE's GEMMs (`kernels.moe.align`); on the Triton path, for decode batches
(up to `ROUTE_ALIGN_MAX_TOKENS` = 32 tokens), both in one launch: each of its E
programs routes every token itself and writes its own expert's segment. That is
one launch fewer per MoE layer of a decode step (48 at 30B-A3B). The threshold
comes from the H100 crossover (`scripts/bench_kernels.py`, rows
`route_topk_and_align[one launch]`; docs/benchmarks.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.checks import FLOAT_DTYPES, check_dtype, check_shape, check_unit_stride_last_dim
from kernels.dispatch import use_triton
from kernels.launch_math import next_power_of_2
from kernels.moe.align import MoeAlignment, empty_alignment
from kernels.pdl import launch_options

# Measured on an H100 (2026-11-25, docs/results/gpu/bench_gpu_2026-11-25.json): one launch is 1.8-1.9x faster
# than route-then-align at 16 and 32 tokens and 0.94x at 64, so the crossover lies between 32 and 64.
ROUTE_ALIGN_MAX_TOKENS = 32
ROUTE_ALIGN_MAX_TILE = 8192  # logits one program of the fused kernel holds: [BLOCK_T, BLOCK_EXPERTS]


class MoeRouting(NamedTuple):
    """A MoE layer's routing, as `fused_moe` takes it: weights [T, K] and int32 ids [T, K], and
    the pairs' layout made ahead for its GEMM blocks (or None: `fused_moe` aligns them itself)."""

    weights: torch.Tensor
    ids: torch.Tensor
    alignment: MoeAlignment | None


def route_topk_reference(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, K] in weights_dtype, topk_ids [T, K] int32)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights.to(weights_dtype), topk_ids.to(torch.int32)


def routing_outputs(
    router_logits: torch.Tensor, top_k: int, weights_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The arguments checked; uninitialised (topk_weights [T, K] in weights_dtype, topk_ids [T, K] int32)."""
    check_shape("router_logits", router_logits, (None, None))
    check_dtype("router_logits", router_logits, FLOAT_DTYPES)
    check_unit_stride_last_dim("router_logits", router_logits)
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(
            f"top_k: must be in [1, {num_experts}] (the number of experts), got {top_k}"
        )
    if weights_dtype not in FLOAT_DTYPES:
        raise ValueError(f"weights_dtype: {weights_dtype} is not a floating dtype the kernel writes")
    # the kernels compute in float32 and round once at the store
    topk_weights = torch.empty((num_tokens, top_k), dtype=weights_dtype, device=router_logits.device)
    return topk_weights, torch.empty((num_tokens, top_k), dtype=torch.int32, device=router_logits.device)


def routing_meta(top_k: int, num_experts: int, renormalize: bool) -> dict:
    """The meta-parameters both routing kernels take."""
    return dict(
        TOP_K=top_k,
        BLOCK_K=next_power_of_2(top_k),
        BLOCK_EXPERTS=next_power_of_2(num_experts),
        RENORMALIZE=renormalize,
    )


def route_topk_triton(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels.jit.moe_routing import route_topk_kernel

    topk_weights, topk_ids = routing_outputs(router_logits, top_k, weights_dtype)
    num_tokens, num_experts = router_logits.shape
    if num_tokens == 0:
        return topk_weights, topk_ids
    route_topk_kernel[(num_tokens,)](
        # pointers
        router_logits,
        topk_weights,
        topk_ids,
        # sizes
        num_experts,
        # strides
        router_logits.stride(0),
        topk_weights.stride(0),
        topk_ids.stride(0),
        # meta-parameters
        **routing_meta(top_k, num_experts, renormalize),
        num_warps=1 if num_experts <= 128 else 4,
        **launch_options(router_logits),
    )
    return topk_weights, topk_ids


def route_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True, weights_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, K] in weights_dtype, topk_ids [T, K] int32),
    sorted by weight, largest first."""
    if use_triton(router_logits, op="route_topk"):
        return route_topk_triton(router_logits, top_k, renormalize, weights_dtype)
    return route_topk_reference(router_logits, top_k, renormalize, weights_dtype)


def route_align_tile(num_tokens: int, num_experts: int) -> int:
    """The logits one program of the fused kernel holds: [BLOCK_T, BLOCK_EXPERTS] (powers of two).
    Computed without triton, which the CPU path must not import."""

    def next_power_of_2(n: int) -> int:
        return 1 << max(n - 1, 0).bit_length()

    return next_power_of_2(num_tokens) * next_power_of_2(num_experts)


def routes_and_aligns_in_one_launch(num_tokens: int, num_experts: int) -> bool:
    """Whether `route_topk_and_align` takes the fused kernel (on the Triton path)."""
    return 0 < num_tokens <= ROUTE_ALIGN_MAX_TOKENS and route_align_tile(num_tokens, num_experts) <= ROUTE_ALIGN_MAX_TILE


def route_topk_and_align_triton(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weights_dtype: torch.dtype,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, MoeAlignment]:
    """One launch, whatever the batch (callers keep it to decode batches: every program
    routes every token)."""
    from kernels.jit.moe_routing import route_topk_align_kernel

    topk_weights, topk_ids = routing_outputs(router_logits, top_k, weights_dtype)
    num_tokens, num_experts = router_logits.shape
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")
    if num_tokens == 0:
        raise ValueError("router_logits: no tokens (route_topk_and_align aligns only when there are some)")
    sorted_token_ids, expert_ids, num_tokens_post_padded = empty_alignment(
        num_tokens * top_k, num_experts, block_size, router_logits.device
    )
    route_topk_align_kernel[(num_experts,)](
        # pointers
        router_logits,
        topk_weights,
        topk_ids,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        # sizes
        num_tokens,
        num_experts,
        block_size,
        # strides
        router_logits.stride(0),
        topk_weights.stride(0),
        topk_ids.stride(0),
        # meta-parameters
        **routing_meta(top_k, num_experts, renormalize),
        BLOCK_T=next_power_of_2(num_tokens),
        BLOCK=min(next_power_of_2(max(num_tokens, block_size)), 1024),
        # two token rows per warp: a row's k rounds of max/argmax are warp shuffles, and the sm_90
        # code grows with the rows a warp holds (2.8k PTX lines at 32 tokens x 16 warps, 7.7k at 4 warps)
        num_warps=min(16, max(1, next_power_of_2(num_tokens) // 2)),
        **launch_options(router_logits),
    )
    alignment = MoeAlignment(sorted_token_ids, expert_ids, num_tokens_post_padded, block_size)
    return topk_weights, topk_ids, alignment


def route_topk_and_align(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    weights_dtype: torch.dtype = torch.float32,
    *,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, MoeAlignment | None]:
    """`route_topk`, plus the pairs' layout for `fused_moe` with GEMM blocks of `block_size` rows
    where one launch makes both (the Triton path, decode batches); None otherwise, and
    `fused_moe` aligns the pairs itself."""
    if use_triton(router_logits, op="route_topk_and_align") and router_logits.dim() == 2 and routes_and_aligns_in_one_launch(
        *router_logits.shape
    ):
        return route_topk_and_align_triton(router_logits, top_k, renormalize, weights_dtype, block_size)
    return (*route_topk(router_logits, top_k, renormalize, weights_dtype), None)
