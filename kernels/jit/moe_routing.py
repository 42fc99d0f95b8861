"""Softmax + top-k over one token's router logits; one program per token.

The top k are picked by k rounds of argmax (ties go to the lower expert id);
each picked entry is then knocked out with -1 (all probabilities are >= 0)."""

import triton
import triton.language as tl


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
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_EXPERTS)
    expert_mask = experts < num_experts
    logits = tl.load(
        logits_ptr + token * stride_logits_token + experts, mask=expert_mask, other=float("-inf")
    ).to(tl.float32)
    exps = tl.exp(logits - tl.max(logits, axis=0))
    probs = exps / tl.sum(exps, axis=0)
    probs = tl.where(expert_mask, probs, -1.0)

    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.argmax(probs, axis=0)
        best_prob = tl.max(probs, axis=0)
        weights = tl.where(slots == slot, best_prob, weights)
        ids = tl.where(slots == slot, best, ids)
        probs = tl.where(experts == best, -1.0, probs)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)

    slot_mask = slots < TOP_K
    tl.store(
        topk_weights_ptr + token * stride_weights_token + slots,
        weights.to(topk_weights_ptr.dtype.element_ty),
        mask=slot_mask,
    )
    tl.store(topk_ids_ptr + token * stride_ids_token + slots, ids, mask=slot_mask)
