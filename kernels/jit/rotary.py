"""Fused per-head RMSNorm + interleaved MRoPE for q and k; one program per token.

Heads are loaded as two halves, x1 = x[:, :D/2] and x2 = x[:, D/2:], so that
rotate_half needs no data movement:  out1 = x1*cos - x2*sin,  out2 = x2*cos + x1*sin
(cos/sin are the same for both halves since emb = cat(freqs, freqs)).
Rounding points follow the torch reference: normed values are rounded to the
output dtype, cos/sin to the input dtype, each product and the sum to the
output dtype. All arithmetic is float32 (bfloat16 only at loads/stores/casts).
"""

import triton
import triton.language as tl

from kernels.jit.pdl import after_previous_grid


@triton.jit
def load_head_halves(
    x_ptr,  # [H, D] at one token's row
    num_heads,
    stride_x_head,
    half_cols,  # [BLOCK_HALF] column index within a half
    half_mask,  # [BLOCK_HALF]
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    HEAD_STRIDE_MULTIPLE: tl.constexpr,  # stride_x_head is a multiple of this
):
    """Every head's first and second half in float32 ([BLOCK_HEADS, BLOCK_HALF] each), and
    the mask of the real heads and columns. The stride hint lets the loads vectorize when
    the head stride is a multiple of 8 but not of 16 (the vision tower's 72), which the
    launcher does not mark."""
    heads = tl.arange(0, BLOCK_HEADS)
    mask = (heads[:, None] < num_heads) & half_mask[None, :]  # [BLOCK_HEADS, BLOCK_HALF]
    head_rows = tl.multiple_of(heads * stride_x_head, HEAD_STRIDE_MULTIPLE)  # [BLOCK_HEADS]
    first = head_rows[:, None] + half_cols[None, :]
    x1 = tl.load(x_ptr + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + first + HEAD_DIM // 2, mask=mask, other=0.0).to(tl.float32)
    return x1, x2, mask


@triton.jit
def store_head_halves(
    out_ptr,  # [H, D] at one token's row
    out1,  # [BLOCK_HEADS, BLOCK_HALF] float32: the first halves
    out2,  # the second halves
    mask,
    stride_out_head,
    half_cols,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    HEAD_STRIDE_MULTIPLE: tl.constexpr,  # stride_out_head is a multiple of this
):
    """Round both halves once to the output's dtype and store them."""
    heads = tl.arange(0, BLOCK_HEADS)
    out_dtype = out_ptr.dtype.element_ty
    out_rows = tl.multiple_of(heads * stride_out_head, HEAD_STRIDE_MULTIPLE)  # [BLOCK_HEADS]
    out_first = out_rows[:, None] + half_cols[None, :]
    tl.store(out_ptr + out_first, out1.to(out_dtype), mask=mask)
    tl.store(out_ptr + out_first + HEAD_DIM // 2, out2.to(out_dtype), mask=mask)


@triton.jit
def _norm_rope_heads(
    # pointers (at the token's row)
    x_ptr,  # [H, D]
    weight_ptr,  # [D]
    out_ptr,  # [H, D]
    # sizes
    num_heads,
    eps,
    # strides
    stride_x_head,
    stride_out_head,
    # per-token values from the caller
    cos,  # [1, BLOCK_HALF] float32, rounded to the input dtype
    sin,  # [1, BLOCK_HALF]
    half_cols,  # [BLOCK_HALF] column index within a half
    half_mask,  # [BLOCK_HALF]
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    HEAD_STRIDE_MULTIPLE: tl.constexpr,
):
    """Normalise and rotate all heads of one token."""
    x1, x2, mask = load_head_halves(x_ptr, num_heads, stride_x_head, half_cols, half_mask, HEAD_DIM, BLOCK_HEADS,
                                    HEAD_STRIDE_MULTIPLE)

    variance = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM  # [BLOCK_HEADS]
    inv_rms = tl.math.rsqrt(variance + eps)[:, None]
    in_dtype = x_ptr.dtype.element_ty
    out_dtype = out_ptr.dtype.element_ty
    w1 = tl.load(weight_ptr + half_cols, mask=half_mask, other=0.0).to(tl.float32)
    w2 = tl.load(weight_ptr + HEAD_DIM // 2 + half_cols, mask=half_mask, other=0.0).to(tl.float32)
    n1 = (w1[None, :] * (x1 * inv_rms).to(in_dtype).to(tl.float32)).to(out_dtype).to(tl.float32)
    n2 = (w2[None, :] * (x2 * inv_rms).to(in_dtype).to(tl.float32)).to(out_dtype).to(tl.float32)

    out1 = (n1 * cos).to(out_dtype).to(tl.float32) + (-n2 * sin).to(out_dtype).to(tl.float32)
    out2 = (n2 * cos).to(out_dtype).to(tl.float32) + (n1 * sin).to(out_dtype).to(tl.float32)
    store_head_halves(out_ptr, out1, out2, mask, stride_out_head, half_cols, HEAD_DIM, BLOCK_HEADS,
                      HEAD_STRIDE_MULTIPLE)


@triton.jit
def qk_norm_mrope_kernel(
    # pointers
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hkv, D]
    q_weight_ptr,  # [D]
    k_weight_ptr,  # [D]
    positions_ptr,  # [3, T] int
    inv_freq_ptr,  # [D/2] float32
    q_out_ptr,  # [T, Hq, D]
    k_out_ptr,  # [T, Hkv, D]
    # sizes
    num_q_heads,
    num_kv_heads,
    eps,
    # strides
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_q_out_token,
    stride_q_out_head,
    stride_k_out_token,
    stride_k_out_head,
    stride_positions_axis,
    stride_positions_token,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # next power of two >= D/2
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    SECTION_H: tl.constexpr,  # mrope_section[1]
    SECTION_W: tl.constexpr,  # mrope_section[2]
    HEAD_STRIDE_MULTIPLE: tl.constexpr,  # every head stride is a multiple of this
):
    after_previous_grid()  # first, before any memory access (kernels/pdl.py)
    token = tl.program_id(0).to(tl.int64)

    # cos/sin for this token, computed inline from its three positions
    position_t = tl.load(positions_ptr + token * stride_positions_token)
    position_h = tl.load(positions_ptr + stride_positions_axis + token * stride_positions_token)
    position_w = tl.load(positions_ptr + 2 * stride_positions_axis + token * stride_positions_token)
    half_cols = tl.arange(0, BLOCK_HALF)
    half_mask = half_cols < HEAD_DIM // 2
    takes_h = (half_cols % 3 == 1) & (half_cols < 3 * SECTION_H)
    takes_w = (half_cols % 3 == 2) & (half_cols < 3 * SECTION_W)
    position = tl.where(takes_h, position_h, tl.where(takes_w, position_w, position_t))
    inv_freq = tl.load(inv_freq_ptr + half_cols, mask=half_mask, other=0.0)
    angle = position.to(tl.float32) * inv_freq  # [BLOCK_HALF]
    in_dtype = q_ptr.dtype.element_ty
    cos = tl.cos(angle).to(in_dtype).to(tl.float32)[None, :]
    sin = tl.sin(angle).to(in_dtype).to(tl.float32)[None, :]

    _norm_rope_heads(
        q_ptr + token * stride_q_token,
        q_weight_ptr,
        q_out_ptr + token * stride_q_out_token,
        num_q_heads,
        eps,
        stride_q_head,
        stride_q_out_head,
        cos,
        sin,
        half_cols,
        half_mask,
        HEAD_DIM,
        BLOCK_Q_HEADS,
        HEAD_STRIDE_MULTIPLE,
    )
    _norm_rope_heads(
        k_ptr + token * stride_k_token,
        k_weight_ptr,
        k_out_ptr + token * stride_k_out_token,
        num_kv_heads,
        eps,
        stride_k_head,
        stride_k_out_head,
        cos,
        sin,
        half_cols,
        half_mask,
        HEAD_DIM,
        BLOCK_KV_HEADS,
        HEAD_STRIDE_MULTIPLE,
    )
