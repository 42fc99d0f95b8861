"""The post-attention residual add, RMSNorm and MoE router logits of a decode batch in one launch,
and with ROUTE the routing and the experts' layout too.

Program p computes the router logits of experts [p * BLOCK_E, (p + 1) * BLOCK_E) for every
token. Each program first norms every token's row itself (a few KiB per row, read from L2),
so none waits for another; program 0 alone stores the new residual and the normed rows.
The arithmetic is `rms_norm_kernel`'s with ADD_RESIDUAL (kernels/jit/rms_norm.py), and the
logits are the normed rows (as stored, in the hidden dtype) times the router weight, summed
in float32 and rounded once to the hidden dtype, as a 16-bit `F.linear` does.

ROUTE: each program then counts its arrival (kernels/arrival_counters.py), and the last one
routes every token on the stored logits and writes the whole align layout (`route_and_align`):
`route_topk_align_kernel`'s outputs, without its launch.

PREFETCH_WEIGHT (a launch with programmatic dependent launch, kernels/pdl.py): each program
first asks for its router rows and the norm weight into L2 (kernels/jit/l2_prefetch.py),
before it waits for the grid before it, which wrote x.
"""

import triton
import triton.language as tl

from kernels.jit.l2_prefetch import prefetch_rows_to_l2
from kernels.jit.moe_routing import softmax_topk
from kernels.jit.pdl import let_next_grid_launch, wait_for_previous_grid


@triton.jit
def _rounded_sum_chunk(x_ptr, residual_ptr, tokens, cols, mask, stride_x_row, stride_residual_row):
    """(x + residual)[tokens, cols] rounded to x's dtype, as float32 [BLOCK_T, BLOCK_H]."""
    rows = tokens[:, None].to(tl.int64)
    x = tl.load(x_ptr + rows * stride_x_row + cols[None, :], mask=mask, other=0.0)
    residual = tl.load(residual_ptr + rows * stride_residual_row + cols[None, :], mask=mask, other=0.0)
    return (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def add_rms_norm_router_kernel(
    # pointers
    x_ptr,  # [T, H] the attention block's output
    residual_ptr,  # [T, H]
    norm_weight_ptr,  # [H]
    gate_weight_ptr,  # [E, H] the router
    normed_ptr,  # [T, H] out (program 0)
    new_residual_ptr,  # [T, H] out (program 0): x + residual
    logits_ptr,  # [T, E] out: this program's experts
    counter_ptr,  # [1] int32 arrival counter, 0 between launches (ROUTE only)
    topk_weights_ptr,  # [T, K] out (ROUTE only), as route_topk_align_kernel writes them
    topk_ids_ptr,  # [T, K] int32 out (ROUTE only)
    sorted_token_ids_ptr,  # [max_padded] int32 out (ROUTE only): the align layout (kernels/moe/align.py)
    expert_ids_ptr,  # [max_padded // block_size_m] int32 out (ROUTE only)
    num_tokens_post_padded_ptr,  # [1] int32 out (ROUTE only)
    # sizes
    num_tokens,
    hidden_size,
    num_experts,
    eps,
    block_size_m,  # ROUTE: the MoE GEMMs' rows per block
    # strides
    stride_x_row,
    stride_residual_row,
    stride_normed_row,
    stride_new_residual_row,
    stride_gate_row,
    stride_logits_row,
    # meta-parameters
    BLOCK_T: tl.constexpr,  # next power of two >= num_tokens: every token in one tile
    BLOCK_E: tl.constexpr,  # experts per program
    BLOCK_H: tl.constexpr,  # hidden columns per step of the two passes
    ROUTE: tl.constexpr,  # the last program to finish routes every token and lays the pairs out too
    TOP_K: tl.constexpr,  # ROUTE: experts per token
    BLOCK_K: tl.constexpr,  # ROUTE: next power of two >= TOP_K
    BLOCK_EXPERTS: tl.constexpr,  # ROUTE: next power of two >= num_experts
    RENORMALIZE: tl.constexpr,  # ROUTE
    BLOCK_PADDED: tl.constexpr,  # ROUTE: next power of two >= the most entries the layout can use
    BLOCK_BLOCKS: tl.constexpr,  # ROUTE: next power of two >= the most blocks the layout can use
    PREFETCH_WEIGHT: tl.constexpr,  # ask for the program's router rows and the norm weight into L2 before the wait
    LINE_ELEMENTS: tl.constexpr,  # weight elements per 128-byte line
    PREFETCH_LINES: tl.constexpr,  # lines of each row per prefetch step
):
    program = tl.program_id(0)
    if PREFETCH_WEIGHT:  # read-only, no grid's output: asked for while the grid before still runs
        prefetch_experts = tl.minimum(program * BLOCK_E + tl.arange(0, BLOCK_E), num_experts - 1)
        prefetch_rows_to_l2(gate_weight_ptr + prefetch_experts[:, None].to(tl.int64) * stride_gate_row, hidden_size,
                            LINE_ELEMENTS, PREFETCH_LINES)
        if program == 0:  # every program reads the norm weight; one asks for it (its elements are no
            # wider than the router's, so a step of LINE_ELEMENTS skips no line of it)
            prefetch_rows_to_l2(norm_weight_ptr + tl.zeros([1, 1], dtype=tl.int64), hidden_size, LINE_ELEMENTS,
                                PREFETCH_LINES)
    wait_for_previous_grid()  # before any other memory access; the next grid launches after the main loop (kernels/jit/pdl.py)
    tokens = tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens

    # pass 1: each row's mean square, of the sum as rounded to the input dtype
    squares = tl.zeros([BLOCK_T], dtype=tl.float32)
    for start in range(0, hidden_size, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        mask = token_mask[:, None] & (cols < hidden_size)[None, :]
        hidden = _rounded_sum_chunk(x_ptr, residual_ptr, tokens, cols, mask, stride_x_row, stride_residual_row)
        squares += tl.sum(hidden * hidden, axis=1)
    inverse_rms = tl.math.rsqrt(squares / hidden_size + eps)  # [BLOCK_T]

    # pass 2: the normed rows, and their products with this program's router rows
    experts = program * BLOCK_E + tl.arange(0, BLOCK_E)
    expert_mask = experts < num_experts
    logits = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for start in range(0, hidden_size, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        col_mask = cols < hidden_size
        mask = token_mask[:, None] & col_mask[None, :]
        hidden = _rounded_sum_chunk(x_ptr, residual_ptr, tokens, cols, mask, stride_x_row, stride_residual_row)
        # cast back to the input dtype before the weight, as transformers' RMSNorm
        scaled = (hidden * inverse_rms[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
        norm_weight = tl.load(norm_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        normed = (scaled * norm_weight[None, :]).to(normed_ptr.dtype.element_ty)  # [BLOCK_T, BLOCK_H]
        if program == 0:
            rows = tokens[:, None].to(tl.int64)
            tl.store(new_residual_ptr + rows * stride_new_residual_row + cols[None, :],
                     hidden.to(new_residual_ptr.dtype.element_ty), mask=mask)
            tl.store(normed_ptr + rows * stride_normed_row + cols[None, :], normed, mask=mask)
        gate = tl.load(
            gate_weight_ptr + experts[:, None].to(tl.int64) * stride_gate_row + cols[None, :],
            mask=expert_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_E, BLOCK_H]
        # [BLOCK_T, 1, BLOCK_H] * [1, BLOCK_E, BLOCK_H] summed over H -> [BLOCK_T, BLOCK_E]
        logits += tl.sum(normed.to(tl.float32)[:, None, :] * gate[None, :, :], axis=2)

    let_next_grid_launch()  # the main loop is done: the next grid may launch (kernels/jit/pdl.py)
    tl.store(
        logits_ptr + tokens[:, None].to(tl.int64) * stride_logits_row + experts[None, :],
        logits.to(logits_ptr.dtype.element_ty),
        mask=token_mask[:, None] & expert_mask[None, :],
    )
    if ROUTE:
        # every thread's stores are issued before one thread signals (release, GPU scope)
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) - 1:  # the last program: every expert's logits are stored
            route_and_align(logits_ptr, stride_logits_row, topk_weights_ptr, topk_ids_ptr, sorted_token_ids_ptr,
                            expert_ids_ptr, num_tokens_post_padded_ptr, num_tokens, num_experts, block_size_m,
                            BLOCK_T, TOP_K, BLOCK_K, BLOCK_EXPERTS, RENORMALIZE, BLOCK_PADDED, BLOCK_BLOCKS)
            tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def route_and_align(
    logits_ptr, stride_logits_row, topk_weights_ptr, topk_ids_ptr, sorted_token_ids_ptr, expert_ids_ptr,
    num_tokens_post_padded_ptr, num_tokens, num_experts, block_size_m,
    BLOCK_T: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_EXPERTS: tl.constexpr,
    RENORMALIZE: tl.constexpr, BLOCK_PADDED: tl.constexpr, BLOCK_BLOCKS: tl.constexpr,
):
    """`route_topk_align_kernel`'s outputs, all written by one program: the top-k of every token's
    logits (as stored, read past L1: other programs wrote them) and the whole expert-sorted
    layout, which that kernel's E programs write a segment each of."""
    tokens = tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens
    experts = tl.arange(0, BLOCK_EXPERTS)
    expert_mask = experts < num_experts
    logits = tl.load(logits_ptr + tokens[:, None].to(tl.int64) * stride_logits_row + experts[None, :],
                     mask=token_mask[:, None] & expert_mask[None, :], other=0.0,
                     cache_modifier=".cg").to(tl.float32)  # [BLOCK_T, BLOCK_EXPERTS]
    logits = tl.where(expert_mask[None, :], logits, float("-inf"))  # padding tokens route like any row
    weights, ids, chosen = softmax_topk(logits, experts, num_experts, BLOCK_T, TOP_K, BLOCK_K, RENORMALIZE)
    chosen = (chosen & token_mask[:, None]).to(tl.int32)  # [BLOCK_T, BLOCK_EXPERTS]
    slots = tl.arange(0, BLOCK_K)
    pair_mask = token_mask[:, None] & (slots < TOP_K)[None, :]
    rows = tokens[:, None].to(tl.int64)
    tl.store(topk_weights_ptr + rows * TOP_K + slots[None, :], weights.to(topk_weights_ptr.dtype.element_ty),
             mask=pair_mask)
    tl.store(topk_ids_ptr + rows * TOP_K + slots[None, :], ids, mask=pair_mask)

    # each expert's segment: its pairs padded to whole blocks, experts in order
    counts = tl.sum(chosen, axis=0)  # [BLOCK_EXPERTS]: a token picks an expert at most once
    padded = tl.cdiv(counts, block_size_m) * block_size_m
    starts = tl.cumsum(padded, axis=0) - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_tokens_post_padded_ptr, total)
    # block b belongs to the expert whose segment holds entry b * block_size_m: the number of
    # experts whose segment ends at or before it (empty segments end where they start)
    blocks = tl.arange(0, BLOCK_BLOCKS)
    first_entries = blocks * block_size_m
    ends = starts + padded
    block_experts = tl.sum((ends[None, :] <= first_entries[:, None]).to(tl.int32), axis=1)  # [BLOCK_BLOCKS]
    tl.store(expert_ids_ptr + blocks, block_experts, mask=first_entries < total)
    # every used entry first holds T*K (padding, masked out by the GEMMs), then the pairs go in
    entries = tl.arange(0, BLOCK_PADDED)
    tl.store(sorted_token_ids_ptr + entries, tl.full([BLOCK_PADDED], 0, tl.int32) + num_tokens * TOP_K,
             mask=entries < total)
    tl.debug_barrier()  # the padding stores before the pair stores that overwrite some of them
    # pair t * K + k goes to its expert's segment, after the earlier tokens that chose that expert
    ranks = tl.cumsum(chosen, axis=0) - chosen  # [BLOCK_T, BLOCK_EXPERTS]
    for slot in tl.static_range(TOP_K):
        expert = tl.sum(tl.where(slots[None, :] == slot, ids, 0), axis=1)  # [BLOCK_T]
        is_expert = experts[None, :] == expert[:, None]  # [BLOCK_T, BLOCK_EXPERTS]
        destination = tl.sum(tl.where(is_expert, starts[None, :] + ranks, 0), axis=1)  # [BLOCK_T]
        tl.store(sorted_token_ids_ptr + destination, tokens * TOP_K + slot, mask=token_mask)
