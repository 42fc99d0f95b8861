"""Paged decode attention: one query token per sequence, split-KV ("flash decoding").

Phase 1, `paged_decode_split_kernel`, grid (Hkv, B, num_splits) (HEADS_TOGETHER, below;
else (B, Hkv, num_splits)): each program owns one sequence, one KV head with all of its query heads (GQA: the K/V tiles are
read once for the whole group, and the group forms the M dimension of `tl.dot`),
and one contiguous range of cache positions. It runs an online softmax over that
range and writes the unnormalised partial output plus its running max and sum
(base-2 exponent domain).

The ranges are sized per sequence (`split_length`): the sequence's own length
shared over the grid's splits, in BLOCK_N multiples and at least
`min_split_tokens`. A CUDA graph fixes the grid for the longest context it may
see (`max_model_len`), so splits sized from that bound put a 2k-token sequence
in one split of the 3-9 launched at batch 8-32; sized from its own length, it
uses as many as `min_split_tokens` allows.

Phase 2, `paged_decode_reduce_kernel`, grid (B, Hq): merges the splits of one
(sequence, query head): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
Splits that start at or past the sequence's length are never written and never
read; a sequence of length 0 (padding) gets a zero output.

Merged in place (MERGE_IN_PLACE, the default with several splits): no reduce launch.
A sequence that one split holds (its length up to `min_split_tokens`) has that split
write its output directly. Otherwise each split stores its partials, the CTA waits
at a barrier for all its threads' stores, and one thread adds 1 to the (sequence,
KV head)'s counter with release-acquire semantics at GPU scope; the split that
brings the count to the number of splits used is the last to finish, merges them
all for the KV head's query heads (`merge_splits`, reading the others' partials
past L1) and puts the counter back to 0 for the next launch: the pattern of
CUTLASS's split-K semaphores. At batch 1 in a CUDA graph (captured for
`max_model_len`, so with many splits) this takes the reduce kernel's launch out
of every layer.

Fused cache write (FUSE_CACHE_WRITE): the current token's K/V arrive as inputs.
The program whose range holds position `context_len - 1` reads the cache only up
to the row before it, adds the token from its inputs as one more key after the
loop (so it never depends on its own store, and the loop has no per-element
select), and writes it to the token's slot. This is race-free because that slot
is read by no other program: other splits cover other positions, and other
sequences never map the last, partially filled block of this one (no prefix
sharing of a block that is still being written).

FP8 caches: K/V tiles are widened to the query's dtype after loading, so the
cache may hold FP8 (e4m3); the fused write rounds the new K/V as
`reshape_and_cache` does and attends to the rounded values, exactly what later
steps read back. With a 16-bit query both dots run in float16 (FP16_DOTS):
- e4m3 widens to float16 exactly, two values per instruction on sm_89+. Widening
  to bfloat16 added a scalar conversion per element: 160 per loop iteration in
  the sm_90 SASS at B=128, on a pipe the CUDA guide rates at 16 per clock per SM.
- A bfloat16 query loses nothing on the way: float16 has more mantissa; only
  magnitudes below 6e-5 lose bits and those past 65504 saturate, and a normed
  query has neither. The probabilities in [0, 1] gain precision.
- V is read as 4-byte words and widened where it lands (`e4m3_words_to_float16`,
  V_WORDS). The second dot sums over positions, which are V's rows; loaded as
  bytes, V went through shared memory one byte at a time (64 single-byte loads per
  thread per iteration) before it was widened. Widened first, it takes a bfloat16
  cache's 16-bit path.
On the H100 of 2026-11-27 this kernel over an FP8 cache ran at 0.172 / 0.223 ms
(B=32 ctx 2k / B=128 ctx 1k) against 0.068 / 0.122 on 2026-11-25, before the
float16 dots and the word reads. `VLM_CATALOG_KERNELS_OFF=fp8_v_words` reads V as
bytes again (cast to float16), and `fp8_float16_dots` runs both dots in the
query's dtype, so the two can be timed apart.

The block size is a compile-time constant, so a position's block and offset are a
shift and a mask rather than a division by a runtime value.

Block ids one tile ahead (IDS_AHEAD, with 3 or more pipeline stages): a tile's K/V
addresses come from the block table, so loaded in the same iteration the K/V loads
are indirect, and Triton's pipeliner then keeps a single tile in flight however many
stages it is given: in the sm_90 SASS (Triton 3.6 and 3.9) each iteration starts by
waiting for every outstanding copy (`DEPBAR.LE SB0, 0x0`), and the next tile's copies
are issued late in the iteration before, after that tile's block ids have come back.
With the ids loaded one iteration early (`tile_blocks` for the next tile, carried
into the loop's next iteration) the K/V addresses no longer wait for a load of their
own iteration, and 3 stages keep one more tile in flight, 4 two more (`0x2`, `0x4`;
B=256, 128 positions a tile: 104 KiB of shared memory at 3 stages against 72.5 KiB).

Heads together (HEADS_TOGETHER): the grid is (KV head, sequence, split), so the
programs of one sequence's KV heads launch one after another and run side by side.
A cache position's rows for the KV heads lie together, [Hkv, D] in the engine's
layout, and one program reads every Hkv-th 128-byte row of a block. With the
grid (sequence, KV head, split), every sequence's head 0 launched before any
head 1: each block was read four times over, a quarter at a time, at four
different moments. Side by side, the four programs read a block's rows at about
the same time.

In the sm_90 SASS at B=128 with the fused write, one loop iteration is 481
instructions per warp with an FP8 cache and 529 with a bfloat16 one (965 and 997
before the float16 dots, the word loads, the constant block size and the current
token's move out of the loop).
"""

import triton
import triton.language as tl

from kernels.jit.fp8_quant import saturate_fp8
from kernels.jit.fp8_widen import e4m3_words_to_float16, saturate_float16
from kernels.jit.pdl import after_previous_grid, let_next_grid_launch, wait_for_previous_grid
from kernels.jit.rotary import load_normed_rotated, mrope_cos_sin_columns


@triton.jit
def split_length(context_len, num_splits, min_split_tokens, BLOCK_N: tl.constexpr):
    """Cache positions per split for a sequence of `context_len` tokens (both kernels use it)."""
    shared = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(shared, min_split_tokens)


@triton.jit
def tile_blocks(block_table, tile_start, end, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The cache block of each position tile_start .. tile_start + BLOCK_N - 1 (int32), 0 from `end` on."""
    positions = tile_start + tl.arange(0, BLOCK_N)
    return tl.load(block_table + positions // BLOCK_SIZE, mask=positions < end, other=0)  # [BLOCK_N]


# step-sized arguments: one compiled variant whatever the step (kernels/jit/__init__.py)
@triton.jit(do_not_specialize=["stride_positions_axis", "stride_partial_stat_head"])
def paged_decode_split_kernel(
    # pointers
    q_ptr,  # [B, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    context_lens_ptr,  # [B] int32, includes the current token
    partial_out_ptr,  # [B, Hq, num_splits, D] float32, unnormalised
    partial_max_ptr,  # [B, Hq, num_splits] float32, running max (log2 domain)
    partial_sum_ptr,  # [B, Hq, num_splits] float32, running sum of 2^(s - max)
    out_ptr,  # [B, Hq, D], written only when SINGLE_SPLIT (the partials are not, then) or MERGE_IN_PLACE
    new_k_ptr,  # [B, Hkv, D], read only when FUSE_CACHE_WRITE
    new_v_ptr,  # [B, Hkv, D], read only when FUSE_CACHE_WRITE
    slot_mapping_ptr,  # [B], read only when FUSE_CACHE_WRITE
    q_norm_weight_ptr,  # [D], read only when NORM_ROPE
    k_norm_weight_ptr,  # [D], read only when NORM_ROPE
    positions_ptr,  # [3, B] int (t, h, w), read only when NORM_ROPE
    inv_freq_ptr,  # [D/2] float32, read only when NORM_ROPE
    merge_counters_ptr,  # [>= B * Hkv] int32, 0 between launches; used only when MERGE_IN_PLACE
    # sizes
    scale_log2,  # softmax scale * log2(e)
    min_split_tokens,  # a multiple of BLOCK_N (split_length)
    queries_per_kv,  # Hq // Hkv
    norm_eps,  # NORM_ROPE's RMSNorm epsilon
    # strides
    stride_q_seq,
    stride_q_head,
    stride_k_cache_block,
    stride_k_cache_offset,
    stride_k_cache_head,
    stride_v_cache_block,
    stride_v_cache_offset,
    stride_v_cache_head,
    stride_block_tables_seq,
    stride_partial_out_seq,
    stride_partial_out_head,
    stride_partial_out_split,
    stride_partial_stat_seq,
    stride_partial_stat_head,
    stride_out_seq,
    stride_out_head,
    stride_new_k_seq,
    stride_new_k_head,
    stride_new_v_seq,
    stride_new_v_head,
    stride_positions_axis,
    stride_positions_seq,
    # meta-parameters
    BLOCK_SIZE: tl.constexpr,  # cache positions per block: a constant, so // and % are shifts and masks
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_G: tl.constexpr,  # >= queries_per_kv, >= 16 for tl.dot
    BLOCK_N: tl.constexpr,  # cache positions per tile
    FUSE_CACHE_WRITE: tl.constexpr,
    SATURATE_FP8: tl.constexpr,  # the cache is float8 e4m3: clamp the written K/V to +-448
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs, "tf32" otherwise (ignored for 16-bit)
    SINGLE_SPLIT: tl.constexpr,  # one split holds the whole context: normalise and write out_ptr here
    FP16_DOTS: tl.constexpr,  # FP8 cache, 16-bit query: both dots in float16 (see the module docstring)
    V_WORDS: tl.constexpr,  # FP16_DOTS: V read as 4-byte words and widened where it lands (module doc)
    WIDEN_WITH_PTX: tl.constexpr,  # V_WORDS on a GPU: V widened by inline PTX (the interpreter runs none)
    NORM_ROPE: tl.constexpr,  # q and the new k arrive raw: RMS-normed and MRoPE-rotated here (module doc)
    SECTION_H: tl.constexpr,  # NORM_ROPE's mrope_section[1]
    SECTION_W: tl.constexpr,  # NORM_ROPE's mrope_section[2]
    MERGE_IN_PLACE: tl.constexpr,  # several splits: the last to finish merges them (no reduce launch)
    BLOCK_MERGE_G: tl.constexpr,  # MERGE_IN_PLACE: next power of two >= queries_per_kv
    MERGE_SPLITS: tl.constexpr,  # MERGE_IN_PLACE: splits merged per step
    IDS_AHEAD: tl.constexpr,  # each tile's cache blocks loaded one iteration before its K/V (module doc)
    HEADS_TOGETHER: tl.constexpr,  # grid (KV head, sequence, split), not (sequence, KV head, split) (module doc)
):
    wait_for_previous_grid()  # first, before any memory access; the next grid launches after the main loop (kernels/jit/pdl.py)
    if HEADS_TOGETHER:  # grid (KV head, sequence, split): a sequence's heads launch one after another
        kv_head, seq, num_kv_heads = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.num_programs(0)
    else:  # grid (sequence, KV head, split)
        seq, kv_head, num_kv_heads = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.num_programs(1)
    split = tl.program_id(2)

    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    group = tl.arange(0, BLOCK_G)
    group_mask = group < queries_per_kv
    q_heads = kv_head * queries_per_kv + group  # [BLOCK_G]
    out_ptrs = out_ptr + seq * stride_out_seq + q_heads[:, None] * stride_out_head + dims[None, :]
    out_mask = group_mask[:, None] & dim_mask[None, :]

    context_len = tl.load(context_lens_ptr + seq)
    tokens_per_split = split_length(context_len, tl.num_programs(2), min_split_tokens, BLOCK_N)
    split_start = split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, context_len)
    if split_start >= split_end:
        if SINGLE_SPLIT or MERGE_IN_PLACE:
            if split == 0:  # a sequence of length 0: zeros, as the reduce kernel gives
                tl.store(out_ptrs, tl.zeros([BLOCK_G, BLOCK_D], dtype=out_ptr.dtype.element_ty), mask=out_mask)
        return
    q_rows = q_ptr + seq * stride_q_seq + q_heads[:, None] * stride_q_head  # [BLOCK_G, 1]
    if NORM_ROPE:  # what qk_norm_mrope would have written for this token, rounded as it rounds
        cos, sin = mrope_cos_sin_columns(positions_ptr + seq * stride_positions_seq, stride_positions_axis,
                                         inv_freq_ptr, dims % (HEAD_DIM // 2), dim_mask, q_ptr.dtype.element_ty,
                                         SECTION_H, SECTION_W)
        cos = cos[None, :]  # [1, BLOCK_D]
        signed_sin = tl.where(dims < HEAD_DIM // 2, -sin, sin)[None, :]  # rotate_half's sign
        q = load_normed_rotated(q_rows, group_mask[:, None], q_norm_weight_ptr, cos, signed_sin, dims, norm_eps,
                                HEAD_DIM).to(q_ptr.dtype.element_ty)  # [BLOCK_G, BLOCK_D]
    else:
        q = tl.load(
            q_rows + dims[None, :], mask=group_mask[:, None] & dim_mask[None, :], other=0.0
        )  # [BLOCK_G, BLOCK_D]
    if FP16_DOTS:  # saturated: a query past float16's range (none a normed query reaches) stays finite
        q = saturate_float16(q)

    if FUSE_CACHE_WRITE:
        new_k_row = new_k_ptr + seq * stride_new_k_seq + kv_head * stride_new_k_head
        if NORM_ROPE:
            one_row = tl.zeros([1, 1], dtype=tl.int32)
            new_k = tl.sum(load_normed_rotated(new_k_row + one_row, one_row == 0, k_norm_weight_ptr, cos, signed_sin,
                                               dims, norm_eps, HEAD_DIM),
                           axis=0).to(new_k_ptr.dtype.element_ty)  # [1, BLOCK_D] -> [BLOCK_D]
        else:
            new_k = tl.load(new_k_row + dims, mask=dim_mask, other=0.0)
        new_v = tl.load(
            new_v_ptr + seq * stride_new_v_seq + kv_head * stride_new_v_head + dims,
            mask=dim_mask,
            other=0.0,
        )
        if SATURATE_FP8:
            new_k = saturate_fp8(new_k)
            new_v = saturate_fp8(new_v)
        new_k = new_k.to(k_cache_ptr.dtype.element_ty)  # as stored
        new_v = new_v.to(v_cache_ptr.dtype.element_ty)
        new_k_seen = new_k.to(q.dtype)  # as later steps will read it back
        new_v_seen = new_v.to(q.dtype)

    running_max = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    block_table = block_tables_ptr + seq * stride_block_tables_seq
    # With the fused write, the split that holds the current token reads the cache up to the row
    # before it and adds the token after the loop, from its inputs.
    holds_current = split_end == context_len
    cache_end = split_end
    if FUSE_CACHE_WRITE:
        cache_end = tl.where(holds_current, split_end - 1, split_end)
    if IDS_AHEAD:  # the first tile's blocks; each iteration then loads the next tile's (module doc)
        next_blocks = tile_blocks(block_table, split_start, cache_end, BLOCK_N, BLOCK_SIZE)
    for tile_start in range(split_start, cache_end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        position_mask = positions < cache_end
        if IDS_AHEAD:
            blocks = next_blocks.to(tl.int64)
            next_blocks = tile_blocks(block_table, tile_start + BLOCK_N, cache_end, BLOCK_N, BLOCK_SIZE)
        else:
            blocks = tile_blocks(block_table, tile_start, cache_end, BLOCK_N, BLOCK_SIZE).to(tl.int64)
        offsets = positions % BLOCK_SIZE
        kv_mask = position_mask[:, None] & dim_mask[None, :]  # [BLOCK_N, BLOCK_D]

        k_ptrs = (
            k_cache_ptr
            + blocks[:, None] * stride_k_cache_block
            + offsets[:, None] * stride_k_cache_offset
            + kv_head * stride_k_cache_head
            + dims[None, :]
        )
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        scores = (
            tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        )  # [BLOCK_G, BLOCK_N]
        scores = tl.where(position_mask[None, :], scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        running_max = new_max

        v_rows = (
            v_cache_ptr + blocks * stride_v_cache_block + offsets * stride_v_cache_offset
            + kv_head * stride_v_cache_head
        )  # [BLOCK_N]
        if V_WORDS:  # an FP8 V read as words and widened where it lands (see the module docstring)
            words = tl.arange(0, BLOCK_D // 4)
            v_words = tl.load(
                v_rows.to(tl.pointer_type(tl.int32))[:, None] + words[None, :],
                mask=position_mask[:, None] & (words < HEAD_DIM // 4)[None, :],
                other=0,
            )  # [BLOCK_N, BLOCK_D // 4]
            v = e4m3_words_to_float16(v_words, WIDEN_WITH_PTX)  # [BLOCK_N, BLOCK_D]
        else:
            v = tl.load(v_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)

    let_next_grid_launch()  # the main loop is done: the next grid may launch (kernels/jit/pdl.py)
    if FUSE_CACHE_WRITE:
        if holds_current:  # one more key: the current token, as stored (float32 vector math)
            current_key = new_k_seen.to(tl.float32)[None, :]  # [1, BLOCK_D]
            current_score = tl.sum(q.to(tl.float32) * current_key, axis=1) * scale_log2  # [BLOCK_G]
            new_max = tl.maximum(running_max, current_score)  # [BLOCK_G]
            rescale = tl.exp2(running_max - new_max)
            current_prob = tl.exp2(current_score - new_max)
            running_sum = running_sum * rescale + current_prob
            running_max = new_max
            acc = acc * rescale[:, None] + current_prob[:, None] * new_v_seen.to(tl.float32)[None, :]

    if SINGLE_SPLIT:
        tl.store(out_ptrs, (acc / running_sum[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
    elif MERGE_IN_PLACE:
        # the splits this sequence's length fills (the reduce kernel counts them the same way)
        splits_used = tl.cdiv(context_len, tokens_per_split)
        if splits_used == 1:  # a short sequence: its one split is the answer
            tl.store(out_ptrs, (acc / running_sum[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            store_partials(partial_out_ptr, partial_max_ptr, partial_sum_ptr, acc, running_max, running_sum, seq,
                           q_heads, group_mask, dims, out_mask, split, stride_partial_out_seq,
                           stride_partial_out_head, stride_partial_out_split, stride_partial_stat_seq,
                           stride_partial_stat_head)
            # every thread's stores are issued before one thread signals (release, GPU scope)
            tl.debug_barrier()
            counter = merge_counters_ptr + seq * num_kv_heads + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == splits_used - 1:  # the last split of this (sequence, KV head) to finish
                merge_splits(partial_out_ptr, partial_max_ptr, partial_sum_ptr, out_ptr, seq, kv_head,
                             queries_per_kv, splits_used, stride_partial_out_seq, stride_partial_out_head,
                             stride_partial_out_split, stride_partial_stat_seq, stride_partial_stat_head,
                             stride_out_seq, stride_out_head, HEAD_DIM, BLOCK_D, BLOCK_MERGE_G, MERGE_SPLITS)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch
    else:
        store_partials(partial_out_ptr, partial_max_ptr, partial_sum_ptr, acc, running_max, running_sum, seq,
                       q_heads, group_mask, dims, out_mask, split, stride_partial_out_seq, stride_partial_out_head,
                       stride_partial_out_split, stride_partial_stat_seq, stride_partial_stat_head)

    if FUSE_CACHE_WRITE:
        # only the split holding position context_len - 1 writes the current token
        slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
        if holds_current & (slot >= 0):
            block = slot // BLOCK_SIZE
            offset = slot % BLOCK_SIZE
            tl.store(
                k_cache_ptr
                + block * stride_k_cache_block
                + offset * stride_k_cache_offset
                + kv_head * stride_k_cache_head
                + dims,
                new_k,
                mask=dim_mask,
            )
            tl.store(
                v_cache_ptr
                + block * stride_v_cache_block
                + offset * stride_v_cache_offset
                + kv_head * stride_v_cache_head
                + dims,
                new_v,
                mask=dim_mask,
            )


@triton.jit
def store_partials(
    partial_out_ptr, partial_max_ptr, partial_sum_ptr, acc, running_max, running_sum, seq, q_heads, group_mask,
    dims, out_mask, split, stride_partial_out_seq, stride_partial_out_head, stride_partial_out_split,
    stride_partial_stat_seq, stride_partial_stat_head,
):
    """One split's unnormalised output [G, D] and its running max and sum [G], for the merge."""
    partial_ptrs = (
        partial_out_ptr
        + seq * stride_partial_out_seq
        + q_heads[:, None] * stride_partial_out_head
        + split * stride_partial_out_split
        + dims[None, :]
    )
    tl.store(partial_ptrs, acc, mask=out_mask)
    stat_offsets = seq * stride_partial_stat_seq + q_heads * stride_partial_stat_head + split
    tl.store(partial_max_ptr + stat_offsets, running_max, mask=group_mask)
    tl.store(partial_sum_ptr + stat_offsets, running_sum, mask=group_mask)


@triton.jit
def merge_splits(
    partial_out_ptr, partial_max_ptr, partial_sum_ptr, out_ptr, seq, kv_head, queries_per_kv, splits_used,
    stride_partial_out_seq, stride_partial_out_head, stride_partial_out_split, stride_partial_stat_seq,
    stride_partial_stat_head, stride_out_seq, stride_out_head,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_MERGE_G: tl.constexpr, MERGE_SPLITS: tl.constexpr,
):
    """The reduce kernel's merge for the query heads of one KV head, by the split kernel's last
    program: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s. The other splits' partials
    are read past L1 (".cg"): they were written by other programs, perhaps on other SMs."""
    heads = kv_head * queries_per_kv + tl.arange(0, BLOCK_MERGE_G)  # [BLOCK_MERGE_G]
    head_mask = tl.arange(0, BLOCK_MERGE_G) < queries_per_kv
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    stat_rows = partial_max_ptr + seq * stride_partial_stat_seq + heads * stride_partial_stat_head  # [G]
    sum_rows = partial_sum_ptr + seq * stride_partial_stat_seq + heads * stride_partial_stat_head
    # pass 1: the largest running max per head
    global_max = tl.full([BLOCK_MERGE_G], float("-inf"), dtype=tl.float32)
    for first in range(0, splits_used, MERGE_SPLITS):
        splits = first + tl.arange(0, MERGE_SPLITS)
        mask = head_mask[:, None] & (splits < splits_used)[None, :]
        split_max = tl.load(stat_rows[:, None] + splits[None, :], mask=mask, other=float("-inf"),
                            cache_modifier=".cg")  # [G, MERGE_SPLITS]
        global_max = tl.maximum(global_max, tl.max(split_max, axis=1))
    global_max = tl.where(global_max == float("-inf"), 0.0, global_max)  # padding heads
    # pass 2: the weighted sums of the partial outputs and of the running sums
    numerator = tl.zeros([BLOCK_MERGE_G, BLOCK_D], dtype=tl.float32)
    denominator = tl.zeros([BLOCK_MERGE_G], dtype=tl.float32)
    out_rows = (partial_out_ptr + seq * stride_partial_out_seq
                + heads[:, None, None] * stride_partial_out_head + dims[None, None, :])  # [G, 1, D]
    for first in range(0, splits_used, MERGE_SPLITS):
        splits = first + tl.arange(0, MERGE_SPLITS)
        mask = head_mask[:, None] & (splits < splits_used)[None, :]  # [G, MERGE_SPLITS]
        split_max = tl.load(stat_rows[:, None] + splits[None, :], mask=mask, other=float("-inf"),
                            cache_modifier=".cg")
        split_sum = tl.load(sum_rows[:, None] + splits[None, :], mask=mask, other=0.0, cache_modifier=".cg")
        weights = tl.exp2(split_max - global_max[:, None])  # [G, MERGE_SPLITS], 0 where masked
        denominator += tl.sum(weights * split_sum, axis=1)
        partial = tl.load(
            out_rows + splits[None, :, None] * stride_partial_out_split,
            mask=mask[:, :, None] & dim_mask[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )  # [G, MERGE_SPLITS, D]
        numerator += tl.sum(weights[:, :, None] * partial, axis=1)
    out = numerator / tl.where(denominator > 0.0, denominator, 1.0)[:, None]
    tl.store(
        out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_mask[:, None] & dim_mask[None, :],
    )


# step-sized arguments: one compiled variant whatever the step (kernels/jit/__init__.py)
@triton.jit(do_not_specialize=["num_splits", "stride_partial_stat_head"])
def paged_decode_reduce_kernel(
    # pointers
    partial_out_ptr,  # [B, Hq, num_splits, D] float32
    partial_max_ptr,  # [B, Hq, num_splits] float32
    partial_sum_ptr,  # [B, Hq, num_splits] float32
    context_lens_ptr,  # [B] int32
    out_ptr,  # [B, Hq, D]
    # sizes
    num_splits,
    min_split_tokens,
    # strides
    stride_partial_out_seq,
    stride_partial_out_head,
    stride_partial_out_split,
    stride_partial_stat_seq,
    stride_partial_stat_head,
    stride_out_seq,
    stride_out_head,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,  # next power of two >= num_splits
    BLOCK_N: tl.constexpr,  # the split kernel's (split_length)
):
    after_previous_grid()  # first, before any memory access (kernels/pdl.py)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    splits_used = tl.cdiv(context_len, split_length(context_len, num_splits, min_split_tokens, BLOCK_N))

    splits = tl.arange(0, BLOCK_SPLITS)
    split_mask = splits < splits_used
    stat_offsets = seq * stride_partial_stat_seq + head * stride_partial_stat_head + splits
    split_max = tl.load(partial_max_ptr + stat_offsets, mask=split_mask, other=float("-inf"))
    split_sum = tl.load(partial_sum_ptr + stat_offsets, mask=split_mask, other=0.0)
    global_max = tl.max(split_max, axis=0)
    global_max = tl.where(global_max == float("-inf"), 0.0, global_max)  # no split: length 0
    weights = tl.exp2(split_max - global_max)  # [BLOCK_SPLITS], 0 for unused splits
    denominator = tl.sum(weights * split_sum, axis=0)

    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    partial_ptrs = (
        partial_out_ptr
        + seq * stride_partial_out_seq
        + head * stride_partial_out_head
        + splits[:, None] * stride_partial_out_split
        + dims[None, :]
    )
    partial = tl.load(partial_ptrs, mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    numerator = tl.sum(weights[:, None] * partial, axis=0)  # [BLOCK_D]
    out = numerator / tl.where(denominator > 0.0, denominator, 1.0)
    tl.store(
        out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )
