"""Non-causal attention within packed segments (vision tower: each image attends
only to itself). Grid (query tiles, segments, heads); a program owns BLOCK_M
query rows of one segment and one head and walks that segment's keys, every key
tile masked, the head in one power-of-two column tile.

A faster form (the head as two column tiles, 72 = 64 + 16, and whole key tiles
read without masks) passed the interpreter's tests but not the GPU's: on the
H200 of 2026-11-27 its wider tiles gave wrong last columns and its default
tiles once left NaN in a 15,625-patch image (kernels/README.md). This is the
form that passed every GPU run before it."""

import triton
import triton.language as tl

from kernels.jit.pdl import after_previous_grid


# step-sized arguments: one compiled variant whatever the step (kernels/jit/__init__.py)
@triton.jit(do_not_specialize=["max_segment_len"])
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
    BLOCK_D: tl.constexpr,  # the next power of two >= HEAD_DIM
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    STRIDE_MULTIPLE: tl.constexpr,  # every stride above is a multiple of this (a power of two <= 16)
):
    after_previous_grid()  # first, before any memory access (kernels/pdl.py)
    # Row offsets carry STRIDE_MULTIPLE as a hint so that loads vectorize when a stride is a
    # multiple of 8 but not of 16 (the launcher marks only multiples of 16): the vision
    # tower's head stride of 72. Without it every bf16 element is its own load.
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
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q_rows = tl.multiple_of(rows * stride_q_token + head * stride_q_head, STRIDE_MULTIPLE)  # [BLOCK_M]
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=q_mask, other=0.0)  # [BLOCK_M, BLOCK_D]

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for tile_start in range(segment_begin, segment_end, BLOCK_N):
        keys = (tile_start + tl.arange(0, BLOCK_N)).to(tl.int64)
        key_mask = keys < segment_end
        kv_mask = key_mask[:, None] & dim_mask[None, :]  # [BLOCK_N, BLOCK_D]
        k_rows = tl.multiple_of(keys * stride_k_token + head * stride_k_head, STRIDE_MULTIPLE)  # [BLOCK_N]
        k = tl.load(k_ptr + k_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        scores = tl.where(key_mask[None, :], scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])  # [BLOCK_M, BLOCK_N]
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        running_max = new_max

        v_rows = tl.multiple_of(keys * stride_v_token + head * stride_v_head, STRIDE_MULTIPLE)  # [BLOCK_N]
        v = tl.load(v_ptr + v_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)

    out_rows = tl.multiple_of(rows * stride_out_token + head * stride_out_head, STRIDE_MULTIPLE)  # [BLOCK_M]
    tl.store(out_ptr + out_rows[:, None] + dims[None, :], (acc / running_sum[:, None]).to(out_ptr.dtype.element_ty),
             mask=q_mask)
