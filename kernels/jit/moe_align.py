"""moe_align_block_size in one launch for a few pairs, else in three over chunks of pairs.

One launch (decode-sized): one program per expert, each counting every expert's pairs itself
and scattering its own (`moe_scatter_kernel` with COUNT_HERE).

Three launches (a prefill's T*K pairs, 131k at 16k tokens): the pairs are cut into chunks.
`moe_count_kernel` (a program per chunk) counts each expert's pairs in its chunk;
`moe_offsets_kernel` (one program) turns that [chunks, experts] table into each (chunk,
expert)'s first entry in the layout, an exclusive prefix over the experts' padded segments and
over the chunks before; `moe_scatter_kernel` (a program per expert and chunk) puts that chunk's
pairs of that expert from there, in order. Before 2026-11-28 one program per expert scanned all
the pairs in a serial loop: 124 us per 16k-token call on the H100 (profile of 2026-11-28),
about 0.18 s of a 256-record run.

The result is deterministic either way (pairs stay in order within an expert, like a stable
sort) without atomics. Each expert's segment (pairs, then padding) and its blocks' expert id
are written whole, so the outputs need no fill launches before (at one decode token the fills
were three of the step's ~18 launches per layer); what lies past `num_tokens_post_padded` is
left unwritten."""

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
def count_experts(topk_ids_ptr, start, end, BLOCK_EXPERTS: tl.constexpr, COUNT_BLOCK: tl.constexpr):
    """How many of the pairs start..end-1 went to each expert: [BLOCK_EXPERTS]."""
    experts = tl.arange(0, BLOCK_EXPERTS)
    counts = tl.zeros([BLOCK_EXPERTS], dtype=tl.int32)
    for first in range(start, end, COUNT_BLOCK):
        pairs = first + tl.arange(0, COUNT_BLOCK)
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < end, other=-1)
        counts += tl.sum((ids[None, :] == experts[:, None]).to(tl.int32), axis=1)  # [E, COUNT_BLOCK] -> [E]
    return counts


# step-sized arguments: one compiled variant whatever the step (kernels/jit/__init__.py)
@triton.jit(do_not_specialize=["num_pairs"])
def moe_count_kernel(
    # pointers
    topk_ids_ptr,  # [T*K]
    chunk_counts_ptr,  # [chunks, E] int32: this program writes its chunk's row
    # sizes
    num_pairs,
    num_experts,
    chunk_size,
    # meta-parameters
    BLOCK_EXPERTS: tl.constexpr,  # next power of two >= num_experts
    COUNT_BLOCK: tl.constexpr,  # pairs per step ([BLOCK_EXPERTS, COUNT_BLOCK] compares)
):
    after_previous_grid()  # first, before any memory access (kernels/pdl.py)
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_EXPERTS)
    start = chunk * chunk_size
    counts = count_experts(topk_ids_ptr, start, tl.minimum(start + chunk_size, num_pairs), BLOCK_EXPERTS, COUNT_BLOCK)
    tl.store(chunk_counts_ptr + chunk * num_experts + experts, counts, mask=experts < num_experts)


# step-sized arguments: one compiled variant whatever the step (kernels/jit/__init__.py)
@triton.jit(do_not_specialize=["num_chunks"])
def moe_offsets_kernel(
    # pointers
    chunk_counts_ptr,  # [chunks, E] int32, from moe_count_kernel
    offsets_ptr,  # [chunks, E] int32: where each (chunk, expert)'s first pair goes
    expert_counts_ptr,  # [E] int32: each expert's pairs in all
    num_tokens_post_padded_ptr,  # [1] int32
    # sizes
    num_chunks,
    num_experts,
    block_size_m,
    # meta-parameters
    BLOCK_CHUNKS: tl.constexpr,  # next power of two >= num_chunks
    BLOCK_EXPERTS: tl.constexpr,  # next power of two >= num_experts
):
    """One program: the exclusive prefix sums over the experts' padded segments and, within an
    expert's segment, over the chunks."""
    after_previous_grid()  # first, before any memory access (kernels/pdl.py)
    chunks = tl.arange(0, BLOCK_CHUNKS)
    experts = tl.arange(0, BLOCK_EXPERTS)
    mask = (chunks < num_chunks)[:, None] & (experts < num_experts)[None, :]
    cells = chunks[:, None] * num_experts + experts[None, :]  # [BLOCK_CHUNKS, BLOCK_EXPERTS]
    table = tl.load(chunk_counts_ptr + cells, mask=mask, other=0)
    counts = tl.sum(table, axis=0)  # [BLOCK_EXPERTS]
    padded_counts = tl.cdiv(counts, block_size_m) * block_size_m
    segment_starts = tl.cumsum(padded_counts, axis=0) - padded_counts  # [BLOCK_EXPERTS]
    earlier_chunks = tl.cumsum(table, axis=0) - table  # [BLOCK_CHUNKS, BLOCK_EXPERTS]
    tl.store(offsets_ptr + cells, segment_starts[None, :] + earlier_chunks, mask=mask)
    tl.store(expert_counts_ptr + experts, counts, mask=experts < num_experts)
    tl.store(num_tokens_post_padded_ptr, tl.sum(padded_counts, axis=0))


@triton.jit
def moe_scatter_kernel(
    # pointers
    topk_ids_ptr,  # [T*K]
    offsets_ptr,  # [chunks, E] int32 from moe_offsets_kernel, read only when not COUNT_HERE
    expert_counts_ptr,  # [E] int32 from moe_offsets_kernel, read only when not COUNT_HERE
    sorted_token_ids_ptr,  # [max_padded] int32: the expert's chunk-0 program writes its padding
    expert_ids_ptr,  # [max_padded // block_size_m] int32: ... and its blocks' expert id
    num_tokens_post_padded_ptr,  # [1] int32, written here only when COUNT_HERE
    # sizes
    num_pairs,
    num_experts,
    block_size_m,
    chunk_size,
    # meta-parameters
    BLOCK: tl.constexpr,
    BLOCK_EXPERTS: tl.constexpr,  # next power of two >= num_experts
    COUNT_HERE: tl.constexpr,  # one launch: one chunk, every expert's pairs counted here
    COUNT_BLOCK: tl.constexpr,  # pairs per step of that count ([BLOCK_EXPERTS, COUNT_BLOCK] compares)
):
    """Program (expert, chunk): the chunk's pairs of that expert, in order, from the first entry
    the offsets give them; the expert's chunk-0 program also writes its padding and blocks."""
    after_previous_grid()  # first, before any memory access (kernels/pdl.py)
    expert = tl.program_id(0)
    chunk = tl.program_id(1)
    if COUNT_HERE:  # this expert's padded segment, from an exclusive prefix sum over all experts
        experts = tl.arange(0, BLOCK_EXPERTS)
        counts = count_experts(topk_ids_ptr, 0, num_pairs, BLOCK_EXPERTS, COUNT_BLOCK)
        segment_start, segment_blocks, count, total = expert_segment(counts, experts, expert, block_size_m)
        if expert == 0:
            tl.store(num_tokens_post_padded_ptr, total)
        first = segment_start
    else:
        first = tl.load(offsets_ptr + chunk * num_experts + expert)
        segment_start = tl.load(offsets_ptr + expert)  # chunk 0's offset: the segment's start
        count = tl.load(expert_counts_ptr + expert)
        segment_blocks = tl.cdiv(count, block_size_m)
    if chunk == 0:
        write_segment_blocks_and_padding(
            sorted_token_ids_ptr, expert_ids_ptr, expert, segment_start, segment_blocks, count, num_pairs,
            block_size_m, BLOCK,
        )

    # the chunk's pairs of this expert, in order: destination = first + rank among them
    rank_base = tl.full([], 0, dtype=tl.int32)
    start = chunk * chunk_size
    end = tl.minimum(start + chunk_size, num_pairs)
    for block_start in range(start, end, BLOCK):
        pairs = block_start + tl.arange(0, BLOCK)
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < end, other=-1)
        hit = (ids == expert).to(tl.int32)
        ranks = rank_base + tl.cumsum(hit, axis=0) - hit  # exclusive prefix count
        tl.store(sorted_token_ids_ptr + first + ranks, pairs, mask=hit > 0)
        rank_base += tl.sum(hit, axis=0)
