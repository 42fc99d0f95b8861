"""Softmax + top-k over router logits, and the same fused with the expert-sorted
layout of `moe_align_block_size` for decode batches.

The top k are picked by k rounds of argmax (ties go to the lower expert id);
each picked entry is then knocked out with -1 (all probabilities are >= 0)."""

import triton
import triton.language as tl

from kernels.jit.moe_align import expert_segment, write_segment_blocks_and_padding
from kernels.jit.pdl import after_previous_grid


@triton.jit
def softmax_topk(
    logits,  # [BLOCK_T, BLOCK_EXPERTS] float32, -inf past num_experts
    experts,  # [BLOCK_EXPERTS] expert ids 0..BLOCK_EXPERTS-1
    num_experts,
    BLOCK_T: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """-> weights [BLOCK_T, BLOCK_K] float32 (0 past TOP_K), ids [BLOCK_T, BLOCK_K] int32, and
    chosen [BLOCK_T, BLOCK_EXPERTS]: whether each row picked each expert."""
    exps = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = exps / tl.sum(exps, axis=1)[:, None]
    expert_mask = experts < num_experts
    probs = tl.where(expert_mask[None, :], probs, -1.0)

    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.argmax(probs, axis=1)  # [BLOCK_T]
        best_prob = tl.max(probs, axis=1)
        weights = tl.where(slots[None, :] == slot, best_prob[:, None], weights)
        ids = tl.where(slots[None, :] == slot, best[:, None], ids)
        probs = tl.where(experts[None, :] == best[:, None], -1.0, probs)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    chosen = (probs == -1.0) & expert_mask[None, :]
    return weights, ids, chosen


@triton.jit
def route_topk_kernel(
    # pointers
    logits_ptr,  # [T, E]
    topk_weights_ptr,  # [T, K], float32 or the hidden dtype (the store rounds)
    topk_ids_ptr,  # [T, K] int32
    # sizes
    num_experts,
    # strides
    stride_logits_token,
    stride_weights_token,
    stride_ids_token,
    # meta-parameters
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of two >= TOP_K
    BLOCK_EXPERTS: tl.constexpr,  # next power of two >= num_experts
    RENORMALIZE: tl.constexpr,
):
    """One program per token."""
    after_previous_grid()  # first, before any memory access (kernels/pdl.py)
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_EXPERTS)
    logits = tl.load(
        logits_ptr + token * stride_logits_token + experts[None, :],
        mask=(experts < num_experts)[None, :],
        other=float("-inf"),
    ).to(tl.float32)  # [1, BLOCK_EXPERTS]
    weights, ids, _ = softmax_topk(logits, experts, num_experts, 1, TOP_K, BLOCK_K, RENORMALIZE)

    slots = tl.arange(0, BLOCK_K)[None, :]  # [1, BLOCK_K]
    slot_mask = slots < TOP_K
    tl.store(
        topk_weights_ptr + token * stride_weights_token + slots,
        weights.to(topk_weights_ptr.dtype.element_ty),
        mask=slot_mask,
    )
    tl.store(topk_ids_ptr + token * stride_ids_token + slots, ids, mask=slot_mask)


# step-sized arguments: one compiled variant whatever the step (kernels/jit/__init__.py)
@triton.jit(do_not_specialize=["num_tokens"])
def route_topk_align_kernel(
    # pointers
    logits_ptr,  # [T, E]
    topk_weights_ptr,  # [T, K] out, as route_topk_kernel's (written by program 0)
    topk_ids_ptr,  # [T, K] int32 out (written by program 0)
    sorted_token_ids_ptr,  # [max_padded] int32 out: this program writes its expert's segment
    expert_ids_ptr,  # [max_padded // block_size_m] int32 out: this program's segment's blocks
    num_tokens_post_padded_ptr,  # [1] int32 out (written by program 0)
    # sizes
    num_tokens,
    num_experts,
    block_size_m,
    # strides
    stride_logits_token,
    stride_weights_token,
    stride_ids_token,
    # meta-parameters
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of two >= TOP_K
    BLOCK_T: tl.constexpr,  # next power of two >= num_tokens: every token in one tile
    BLOCK_EXPERTS: tl.constexpr,  # next power of two >= num_experts
    RENORMALIZE: tl.constexpr,
    BLOCK: tl.constexpr,  # entries per store of the segment's blocks and padding
):
    """One program per expert; each routes every token (a [BLOCK_T, BLOCK_EXPERTS] tile: decode
    batches only), counts every expert's pairs from what the tokens chose, and writes its own
    expert's segment of the align layout, as `moe_scatter_kernel` does."""
    after_previous_grid()  # first, before any memory access (kernels/pdl.py)
    expert = tl.program_id(0)
    tokens = tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens
    experts = tl.arange(0, BLOCK_EXPERTS)
    logits = tl.load(
        logits_ptr + tokens[:, None].to(tl.int64) * stride_logits_token + experts[None, :],
        mask=token_mask[:, None] & (experts < num_experts)[None, :],
        other=0.0,  # padding tokens route like any row; nothing of theirs is written or counted
    ).to(tl.float32)  # [BLOCK_T, BLOCK_EXPERTS]
    logits = tl.where((experts < num_experts)[None, :], logits, float("-inf"))
    weights, ids, chosen = softmax_topk(logits, experts, num_experts, BLOCK_T, TOP_K, BLOCK_K, RENORMALIZE)
    chosen = chosen & token_mask[:, None]

    counts = tl.sum(chosen.to(tl.int32), axis=0)  # [BLOCK_EXPERTS]: a token picks an expert at most once
    segment_start, segment_blocks, count, total = expert_segment(counts, experts, expert, block_size_m)
    slots = tl.arange(0, BLOCK_K)
    if expert == 0:
        pair_mask = token_mask[:, None] & (slots < TOP_K)[None, :]
        rows = tokens[:, None].to(tl.int64)
        tl.store(
            topk_weights_ptr + rows * stride_weights_token + slots[None, :],
            weights.to(topk_weights_ptr.dtype.element_ty),
            mask=pair_mask,
        )
        tl.store(topk_ids_ptr + rows * stride_ids_token + slots[None, :], ids, mask=pair_mask)
        tl.store(num_tokens_post_padded_ptr, total)
    write_segment_blocks_and_padding(
        sorted_token_ids_ptr, expert_ids_ptr, expert, segment_start, segment_blocks, count,
        num_tokens * TOP_K, block_size_m, BLOCK,
    )

    # this expert's pairs t * K + k in token order: a token's rank is how many earlier tokens chose it
    mine = tl.sum(tl.where(experts[None, :] == expert, chosen.to(tl.int32), 0), axis=1)  # [BLOCK_T]
    picked = (ids == expert) & (slots < TOP_K)[None, :]  # padding slots hold id 0
    slot = tl.sum(tl.where(picked, slots[None, :], 0), axis=1)  # [BLOCK_T], valid where mine
    ranks = tl.cumsum(mine, axis=0) - mine
    tl.store(sorted_token_ids_ptr + segment_start + ranks, tokens * TOP_K + slot, mask=mine > 0)
