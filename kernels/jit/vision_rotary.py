"""2D rotary embedding of the vision tower's q and k; one program per patch.

Heads are loaded as two halves, x1 = x[:, :D/2] and x2 = x[:, D/2:], so that
rotate_half needs no data movement:
    out1 = x1 * cos1 - x2 * sin1,   out2 = x2 * cos2 + x1 * sin2
(cos = [cos1, cos2], sin = [sin1, sin2] per patch, float32). Arithmetic is float32,
rounded once to the input dtype at the store, as in the torch reference.
"""

import triton
import triton.language as tl

from kernels.jit.pdl import after_previous_grid
from kernels.jit.rotary import load_head_halves, store_head_halves


@triton.jit
def _rotate_heads(
    # pointers (at the patch's row)
    x_ptr,  # [H, D]
    out_ptr,  # [H, D]
    # sizes
    num_heads,
    # strides
    stride_x_head,
    stride_out_head,
    # per-patch values from the caller
    cos1,  # [1, BLOCK_HALF] float32
    cos2,
    sin1,
    sin2,
    half_cols,  # [BLOCK_HALF] column index within a half
    half_mask,  # [BLOCK_HALF]
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    HEAD_STRIDE_MULTIPLE: tl.constexpr,
):
    x1, x2, mask = load_head_halves(x_ptr, num_heads, stride_x_head, half_cols, half_mask, HEAD_DIM, BLOCK_HEADS,
                                    HEAD_STRIDE_MULTIPLE)
    out1 = x1 * cos1 - x2 * sin1
    out2 = x2 * cos2 + x1 * sin2
    store_head_halves(out_ptr, out1, out2, mask, stride_out_head, half_cols, HEAD_DIM, BLOCK_HEADS,
                      HEAD_STRIDE_MULTIPLE)


@triton.jit
def vision_rotary_kernel(
    # pointers
    q_ptr,  # [N, H, D]
    k_ptr,  # [N, H, D]
    cos_ptr,  # [N, D] float32
    sin_ptr,  # [N, D] float32
    q_out_ptr,  # [N, H, D]
    k_out_ptr,  # [N, H, D]
    # sizes
    num_heads,
    # strides
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_cos_token,
    stride_sin_token,
    stride_out_token,  # q_out and k_out share their layout
    stride_out_head,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # next power of two >= D/2
    BLOCK_HEADS: tl.constexpr,  # next power of two >= H
    STRIDE_MULTIPLE: tl.constexpr,  # the head strides and cos/sin's token strides are multiples of this
):
    after_previous_grid()  # first, before any memory access (kernels/pdl.py)
    token = tl.program_id(0).to(tl.int64)
    half_cols = tl.arange(0, BLOCK_HALF)
    half_mask = half_cols < HEAD_DIM // 2
    cos_row = cos_ptr + tl.multiple_of(token * stride_cos_token, STRIDE_MULTIPLE) + half_cols
    sin_row = sin_ptr + tl.multiple_of(token * stride_sin_token, STRIDE_MULTIPLE) + half_cols
    cos1 = tl.load(cos_row, mask=half_mask, other=0.0)[None, :]
    cos2 = tl.load(cos_row + HEAD_DIM // 2, mask=half_mask, other=0.0)[None, :]
    sin1 = tl.load(sin_row, mask=half_mask, other=0.0)[None, :]
    sin2 = tl.load(sin_row + HEAD_DIM // 2, mask=half_mask, other=0.0)[None, :]
    _rotate_heads(
        q_ptr + token * stride_q_token,
        q_out_ptr + token * stride_out_token,
        num_heads,
        stride_q_head,
        stride_out_head,
        cos1,
        cos2,
        sin1,
        sin2,
        half_cols,
        half_mask,
        HEAD_DIM,
        BLOCK_HEADS,
        STRIDE_MULTIPLE,
    )
    _rotate_heads(
        k_ptr + token * stride_k_token,
        k_out_ptr + token * stride_out_token,
        num_heads,
        stride_k_head,
        stride_out_head,
        cos1,
        cos2,
        sin1,
        sin2,
        half_cols,
        half_mask,
        HEAD_DIM,
        BLOCK_HEADS,
        STRIDE_MULTIPLE,
    )
