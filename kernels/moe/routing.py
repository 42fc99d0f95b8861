"""Top-k expert routing: softmax over experts in float32, keep the k largest.

As transformers' `Qwen3VLMoeTextTopKRouter`: ``softmax(logits, float32)``,
``torch.topk``, then divide by the sum of the kept weights (the model always
renormalises; the flag is kept for other checkpoints). The weights are computed
in float32; transformers then casts them to the hidden dtype for the experts,
which `weights_dtype` does at the store (one launch fewer per MoE layer).
"""

from __future__ import annotations

import torch

from kernels.checks import FLOAT_DTYPES, check_dtype, check_shape, check_unit_stride_last_dim
from kernels.dispatch import use_triton


def route_topk_reference(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, K] in weights_dtype, topk_ids [T, K] int32)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights.to(weights_dtype), topk_ids.to(torch.int32)


def route_topk_triton(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    import triton

    from kernels.jit.moe_routing import route_topk_kernel

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
    device = router_logits.device
    # the kernel computes in float32 and rounds once at the store
    topk_weights = torch.empty((num_tokens, top_k), dtype=weights_dtype, device=device)
    topk_ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)
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
        TOP_K=top_k,
        BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_EXPERTS=triton.next_power_of_2(num_experts),
        RENORMALIZE=renormalize,
        num_warps=1 if num_experts <= 128 else 4,
    )
    return topk_weights, topk_ids


def route_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True, weights_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, K] in weights_dtype, topk_ids [T, K] int32),
    sorted by weight, largest first."""
    if use_triton(router_logits):
        return route_topk_triton(router_logits, top_k, renormalize, weights_dtype)
    return route_topk_reference(router_logits, top_k, renormalize, weights_dtype)
