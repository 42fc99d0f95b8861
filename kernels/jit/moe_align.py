"""moe_align_block_size in two launches, one program per expert each (or, for a
few pairs, one: each scatter program counts every expert's pairs itself).

Every program scans all T*K expert ids (L2-resident: 8 * T int32), which keeps
the result deterministic (pairs stay in order within an expert, like a stable
sort) without atomics. Each program writes its own segment whole (pairs, then
padding) and its blocks' expert id, so the outputs need no fill launches before
(at one decode token, the fills were three of the step's ~18 launches per layer);
what lies past `num_tokens_post_padded` is left unwritten."""

import triton
import triton.language as tl

from kernels.jit.pdl import after_previous_grid


@triton.jit
def expert_segment(counts, experts, expert, block_size_m):
    """counts [BLOCK_EXPERTS] of every expert -> `expert`'s padded segment: (first entry, blocks,
    pairs), and the padded total, from an exclusive prefix sum over the experts."""
    padded_counts = tl.cdiv(counts, block_size_m) * block_size_m
    padded_starts = tl.cumsum(padded_counts, axis=0) - padded_counts
    is_mine = experts == expert
    segment_start = tl.sum(tl.where(is_mine, padded_starts, 0), axis=0)
    segment_blocks = tl.sum(tl.where(is_mine, padded_counts, 0), axis=0) // block_size_m
    count = tl.sum(tl.where(is_mine, counts, 0), axis=0)
    return segment_start, segment_blocks, count, tl.sum(padded_counts, axis=0)


@triton.jit
def write_segment_blocks_and_padding(
    sorted_token_ids_ptr, expert_ids_ptr, expert, segment_start, segment_blocks, count, num_pairs,
    block_size_m, BLOCK: tl.constexpr,
):
    """The segment's blocks' expert id, and its padding (the entries after its `count` pairs,
    fewer than block_size_m), which holds T*K for the GEMMs to mask out."""
    first_block = segment_start // block_size_m
    for start in range(0, segment_blocks, BLOCK):
        blocks = start + tl.arange(0, BLOCK)
        tl.store(
            expert_ids_ptr + first_block + blocks,
            tl.full([BLOCK], 0, tl.int32) + expert,
            mask=blocks < segment_blocks,
        )
    for start in range(count, segment_blocks * block_size_m, BLOCK):
        slots = start + tl.arange(0, BLOCK)
        tl.store(
            sorted_token_ids_ptr + segment_start + slots,
            tl.full([BLOCK], 0, tl.int32) + num_pairs,
            mask=slots < segment_blocks * block_size_m,
        )


@triton.jit
def moe_count_kernel(
    # pointers
    topk_ids_ptr,  # [T*K]
    counts_ptr,  # [E] int32
    # sizes
    num_pairs,
    # meta-parameters
    BLOCK: tl.constexpr,
):
    after_previous_grid()  # first, before any memory access (kernels/pdl.py)
    expert = tl.program_id(0)
    hits = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK):
        pairs = start + tl.arange(0, BLOCK)
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        hits += (ids == expert).to(tl.int32)
    tl.store(counts_ptr + expert, tl.sum(hits, axis=0))


@triton.jit
def moe_scatter_kernel(
    # pointers
    topk_ids_ptr,  # [T*K]
    counts_ptr,  # [E] int32, read only when not COUNT_HERE
    sorted_token_ids_ptr,  # [max_padded] int32: this program writes its segment, padding included
    expert_ids_ptr,  # [max_padded // block_size_m] int32: this program writes its segment's blocks
    num_tokens_post_padded_ptr,  # [1] int32
    # sizes
    num_pairs,
    num_experts,
    block_size_m,
    # meta-parameters
    BLOCK: tl.constexpr,
    BLOCK_EXPERTS: tl.constexpr,  # next power of two >= num_experts
    COUNT_HERE: tl.constexpr,  # count every expert's pairs here instead of reading counts_ptr
    COUNT_BLOCK: tl.constexpr,  # pairs per step of that count ([BLOCK_EXPERTS, COUNT_BLOCK] compares)
):
    after_previous_grid()  # first, before any memory access (kernels/pdl.py)
    expert = tl.program_id(0)

    # this expert's padded segment, from an exclusive prefix sum over all experts
    experts = tl.arange(0, BLOCK_EXPERTS)
    if COUNT_HERE:
        counts = tl.zeros([BLOCK_EXPERTS], dtype=tl.int32)
        for start in range(0, num_pairs, COUNT_BLOCK):
            pairs = start + tl.arange(0, COUNT_BLOCK)
            ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
            counts += tl.sum((ids[None, :] == experts[:, None]).to(tl.int32), axis=1)
    else:
        counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    segment_start, segment_blocks, count, total = expert_segment(counts, experts, expert, block_size_m)
    if expert == 0:
        tl.store(num_tokens_post_padded_ptr, total)
    write_segment_blocks_and_padding(
        sorted_token_ids_ptr, expert_ids_ptr, expert, segment_start, segment_blocks, count, num_pairs,
        block_size_m, BLOCK,
    )

    # pairs of this expert, in order: destination = segment start + rank among them
    rank_base = tl.full([], 0, dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK):
        pairs = start + tl.arange(0, BLOCK)
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        hit = (ids == expert).to(tl.int32)
        ranks = rank_base + tl.cumsum(hit, axis=0) - hit  # exclusive prefix count
        tl.store(sorted_token_ids_ptr + segment_start + ranks, pairs, mask=hit > 0)
        rank_base += tl.sum(hit, axis=0)
