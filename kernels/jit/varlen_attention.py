"""Non-causal attention within packed segments (vision tower: each image attends
only to itself). Grid (query tiles, segments, heads); a program owns BLOCK_M
query rows of one segment and one head and walks that segment's keys.

The head is held as two column tiles: the first BLOCK_D columns (a power of two)
and, where the head size is not one, the remaining HEAD_DIM - BLOCK_D columns in a
TAIL_D-wide tile (a power of two, at least 16: a tensor-core step). The vision
tower's 72 columns are then 64 + 16 instead of one tile of 128, so the two dots
of each key tile do 80 columns' work, not 128. Every key tile but the last
of a segment is whole and is read without masks."""

import triton
import triton.language as tl

from kernels.jit.pdl import after_previous_grid


@triton.jit
def _load_rows(ptr, rows, row_mask, FIRST_DIM: tl.constexpr, MASK_ROWS: tl.constexpr, WIDTH: tl.constexpr,
               HEAD_DIM: tl.constexpr):
    """[R, WIDTH] of the head's columns FIRST_DIM.. at the row offsets `rows` (zeros where masked:
    rows where MASK_ROWS and not `row_mask`, and columns past HEAD_DIM)."""
    dims = FIRST_DIM + tl.arange(0, WIDTH)
    if MASK_ROWS:
        mask = row_mask[:, None] & (dims < HEAD_DIM)[None, :]
        return tl.load(ptr + rows[:, None] + dims[None, :], mask=mask, other=0.0)
    if FIRST_DIM + WIDTH > HEAD_DIM:  # the tail tile's padding columns
        return tl.load(ptr + rows[:, None] + dims[None, :], mask=(dims < HEAD_DIM)[None, :], other=0.0)
    return tl.load(ptr + rows[:, None] + dims[None, :])


@triton.jit
def _attend_key_tile(
    q_main, q_tail, acc_main, acc_tail, running_max, running_sum,
    k_ptr, v_ptr, tile_start, segment_end, head,
    stride_k_token, stride_k_head, stride_v_token, stride_v_head, scale_log2,
    MASK_KEYS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TAIL_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, STRIDE_MULTIPLE: tl.constexpr,
):
    """One online-softmax step over BLOCK_N keys from tile_start (masked past segment_end
    only when MASK_KEYS): the updated (acc_main, acc_tail, running_max, running_sum)."""
    keys = (tile_start + tl.arange(0, BLOCK_N)).to(tl.int64)
    key_mask = keys < segment_end
    # Row offsets carry STRIDE_MULTIPLE as a hint so that loads vectorize when a stride is a
    # multiple of 8 but not of 16 (the launcher marks only multiples of 16): the vision
    # tower's head stride of 72. Without it every bf16 element is its own load.
    k_rows = tl.multiple_of(keys * stride_k_token + head * stride_k_head, STRIDE_MULTIPLE)  # [BLOCK_N]
    k_main = _load_rows(k_ptr, k_rows, key_mask, 0, MASK_KEYS, BLOCK_D, HEAD_DIM)  # [BLOCK_N, BLOCK_D]
    scores = tl.dot(q_main, tl.trans(k_main), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    if TAIL_D > 0:
        k_tail = _load_rows(k_ptr, k_rows, key_mask, BLOCK_D, MASK_KEYS, TAIL_D, HEAD_DIM)  # [BLOCK_N, TAIL_D]
        scores = tl.dot(q_tail, tl.trans(k_tail), acc=scores, input_precision=DOT_PRECISION)
    scores = scores * scale_log2
    if MASK_KEYS:
        scores = tl.where(key_mask[None, :], scores, float("-inf"))

    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    rescale = tl.exp2(running_max - new_max)
    probs = tl.exp2(scores - new_max[:, None])  # [BLOCK_M, BLOCK_N]
    running_sum = running_sum * rescale + tl.sum(probs, axis=1)

    v_rows = tl.multiple_of(keys * stride_v_token + head * stride_v_head, STRIDE_MULTIPLE)  # [BLOCK_N]
    v_main = _load_rows(v_ptr, v_rows, key_mask, 0, MASK_KEYS, BLOCK_D, HEAD_DIM)  # [BLOCK_N, BLOCK_D]
    acc_main = tl.dot(probs.to(v_main.dtype), v_main, acc=acc_main * rescale[:, None], input_precision=DOT_PRECISION)
    if TAIL_D > 0:
        v_tail = _load_rows(v_ptr, v_rows, key_mask, BLOCK_D, MASK_KEYS, TAIL_D, HEAD_DIM)  # [BLOCK_N, TAIL_D]
        acc_tail = tl.dot(probs.to(v_tail.dtype), v_tail, acc=acc_tail * rescale[:, None],
                          input_precision=DOT_PRECISION)
    return acc_main, acc_tail, new_max, running_sum


@triton.jit
def varlen_attention_kernel(
    # pointers
    q_ptr,  # [N, H, D]
    k_ptr,  # [N, H, D]
    v_ptr,  # [N, H, D]
    cu_seqlens_ptr,  # [n + 1] int32
    out_ptr,  # [N, H, D]
    # sizes
    scale_log2,  # softmax scale * log2(e)
    max_segment_len,  # segments longer than this are left alone (another backend writes them)
    # strides
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_out_token,
    stride_out_head,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # the first column tile: a power of two <= HEAD_DIM (or HEAD_DIM's next one)
    TAIL_D: tl.constexpr,  # the second: 0, or a power of two >= 16 covering HEAD_DIM - BLOCK_D
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    STRIDE_MULTIPLE: tl.constexpr,  # every stride above is a multiple of this (a power of two <= 16)
    UNMASKED_WHOLE_TILES: tl.constexpr,  # whole key tiles read without masks (float32 spilled so)
):
    after_previous_grid()  # first, before any memory access (kernels/pdl.py)
    query_tile = tl.program_id(0)
    segment = tl.program_id(1)
    head = tl.program_id(2)

    segment_begin = tl.load(cu_seqlens_ptr + segment)
    segment_end = tl.load(cu_seqlens_ptr + segment + 1)
    first_row = segment_begin + query_tile * BLOCK_M
    if first_row >= segment_end or segment_end - segment_begin > max_segment_len:
        return

    rows = (first_row + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < segment_end
    q_rows = tl.multiple_of(rows * stride_q_token + head * stride_q_head, STRIDE_MULTIPLE)  # [BLOCK_M]
    q_main = _load_rows(q_ptr, q_rows, row_mask, 0, True, BLOCK_D, HEAD_DIM)  # [BLOCK_M, BLOCK_D]
    if TAIL_D > 0:
        q_tail = _load_rows(q_ptr, q_rows, row_mask, BLOCK_D, True, TAIL_D, HEAD_DIM)  # [BLOCK_M, TAIL_D]
    else:
        q_tail = q_main  # not read

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_main = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc_tail = tl.zeros([BLOCK_M, TAIL_D if TAIL_D > 0 else 16], dtype=tl.float32)  # [BLOCK_M, TAIL_D]
    if UNMASKED_WHOLE_TILES:
        loop_end = segment_begin + (segment_end - segment_begin) // BLOCK_N * BLOCK_N  # the whole key tiles
    else:
        loop_end = segment_end  # every key tile, masked
    for tile_start in range(segment_begin, loop_end, BLOCK_N):
        acc_main, acc_tail, running_max, running_sum = _attend_key_tile(
            q_main, q_tail, acc_main, acc_tail, running_max, running_sum,
            k_ptr, v_ptr, tile_start, segment_end, head,
            stride_k_token, stride_k_head, stride_v_token, stride_v_head, scale_log2,
            not UNMASKED_WHOLE_TILES, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_N, DOT_PRECISION, STRIDE_MULTIPLE,
        )
    if loop_end < segment_end:  # the segment's last, partial key tile
        acc_main, acc_tail, running_max, running_sum = _attend_key_tile(
            q_main, q_tail, acc_main, acc_tail, running_max, running_sum,
            k_ptr, v_ptr, loop_end, segment_end, head,
            stride_k_token, stride_k_head, stride_v_token, stride_v_head, scale_log2,
            True, HEAD_DIM, BLOCK_D, TAIL_D, BLOCK_N, DOT_PRECISION, STRIDE_MULTIPLE,
        )

    out_rows = tl.multiple_of(rows * stride_out_token + head * stride_out_head, STRIDE_MULTIPLE)  # [BLOCK_M]
    main_dims = tl.arange(0, BLOCK_D)
    tl.store(
        out_ptr + out_rows[:, None] + main_dims[None, :],
        (acc_main / running_sum[:, None]).to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & (main_dims < HEAD_DIM)[None, :],
    )
    if TAIL_D > 0:
        tail_dims = BLOCK_D + tl.arange(0, TAIL_D)
        tl.store(
            out_ptr + out_rows[:, None] + tail_dims[None, :],
            (acc_tail / running_sum[:, None]).to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & (tail_dims < HEAD_DIM)[None, :],
        )
