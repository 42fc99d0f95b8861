"""Varlen chunked-prefill attention over the paged KV cache.

Grid (query tiles, sequences, query heads). A program owns BLOCK_M consecutive
new query tokens of one sequence and one query head. Query j of a sequence with
q_len new tokens and context_len cached tokens (prefix + this chunk, already in
the cache) sits at absolute position ``context_len - q_len + j`` and attends to
cached positions <= its own, so the program walks cache tiles from position 0 up
to its last query's position, masking only by causality and the sequence end.
Online softmax in float32, base-2 exponent domain. K/V tiles are converted to
the query's dtype after loading, so the cache may hold FP8 (e4m3); with a 16-bit
query over an FP8 cache both dots run in float16 (FP16_DOTS; the reasons are in
jit/paged_decode_attention.py). The block size is a compile-time constant.

Sequences with nothing cached before their chunk and at least `skip_fresh_from`
new tokens are skipped (their output rows are left for SDPA, see
kernels/paged_prefill_attention.py); pass a length no chunk reaches to compute all.
"""

import triton
import triton.language as tl

from kernels.jit.fp8_widen import saturate_float16
from kernels.jit.pdl import after_previous_grid


# step-sized arguments: one compiled variant whatever the step (kernels/jit/__init__.py)
@triton.jit(do_not_specialize=["skip_fresh_from"])
def paged_prefill_attention_kernel(
    # pointers
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    cu_seqlens_q_ptr,  # [B + 1] int32
    context_lens_ptr,  # [B] int32
    out_ptr,  # [T, Hq, D]
    # sizes
    scale_log2,  # softmax scale * log2(e)
    queries_per_kv,  # Hq // Hkv
    skip_fresh_from,  # fresh chunks (no cached prefix) of at least this many tokens are skipped
    # strides
    stride_q_token,
    stride_q_head,
    stride_k_cache_block,
    stride_k_cache_offset,
    stride_k_cache_head,
    stride_v_cache_block,
    stride_v_cache_offset,
    stride_v_cache_head,
    stride_block_tables_seq,
    stride_out_token,
    stride_out_head,
    # meta-parameters
    BLOCK_SIZE: tl.constexpr,  # cache positions per block: a constant, so // and % are shifts and masks
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_M: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # cache positions per tile
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,  # FP8 cache, 16-bit query: both dots in float16 (module docstring)
):
    after_previous_grid()  # first, before any memory access (kernels/pdl.py)
    query_tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)

    query_begin = tl.load(cu_seqlens_q_ptr + seq)
    query_len = tl.load(cu_seqlens_q_ptr + seq + 1) - query_begin
    if query_tile * BLOCK_M >= query_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    prefix_len = context_len - query_len
    if (prefix_len == 0) & (query_len >= skip_fresh_from):
        return
    kv_head = head // queries_per_kv

    rows = query_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the sequence
    row_mask = rows < query_len
    query_positions = prefix_len + rows
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_tokens = (query_begin + rows).to(tl.int64)
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(
        q_ptr + q_tokens[:, None] * stride_q_token + head * stride_q_head + dims[None, :],
        mask=q_mask,
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if FP16_DOTS:  # as in paged_decode_attention.py: an FP8 cache widens to float16 exactly
        q = saturate_float16(q)

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    block_table = block_tables_ptr + seq * stride_block_tables_seq
    # the last query of this tile (clipped to the sequence) bounds the positions to read
    kv_end = tl.minimum(context_len, prefix_len + (query_tile + 1) * BLOCK_M)
    for tile_start in range(0, kv_end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        position_mask = positions < kv_end
        blocks = tl.load(block_table + positions // BLOCK_SIZE, mask=position_mask, other=0).to(
            tl.int64
        )
        offsets = positions % BLOCK_SIZE
        kv_mask = position_mask[:, None] & dim_mask[None, :]  # [BLOCK_N, BLOCK_D]

        k = tl.load(
            k_cache_ptr
            + blocks[:, None] * stride_k_cache_block
            + offsets[:, None] * stride_k_cache_offset
            + kv_head * stride_k_cache_head
            + dims[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(q.dtype)  # [BLOCK_N, BLOCK_D]; an FP8 cache is widened here
        scores = (
            tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        )  # [BLOCK_M, BLOCK_N]
        visible = (positions[None, :] <= query_positions[:, None]) & position_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))

        # every row sees position 0 in the first tile, so new_max is finite from then on
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        running_max = new_max

        v = tl.load(
            v_cache_ptr
            + blocks[:, None] * stride_v_cache_block
            + offsets[:, None] * stride_v_cache_offset
            + kv_head * stride_v_cache_head
            + dims[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)

    out = acc / running_sum[:, None]
    tl.store(
        out_ptr + q_tokens[:, None] * stride_out_token + head * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )
