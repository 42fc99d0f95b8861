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
    n1 = rms_normed(x1, w1[None, :], inv_rms, in_dtype, out_dtype)
    n2 = rms_normed(x2, w2[None, :], inv_rms, in_dtype, out_dtype)

    out1 = rotated(n1, n2, cos, -sin, out_dtype)
    out2 = rotated(n2, n1, cos, sin, out_dtype)
    store_head_halves(out_ptr, out1, out2, mask, stride_out_head, half_cols, HEAD_DIM, BLOCK_HEADS,
                      HEAD_STRIDE_MULTIPLE)


@triton.jit
def rms_normed(x, weight, inv_rms, IN_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """weight * (x * inv_rms), with the reference's roundings: the normed value to the input's
    dtype, the product to the output's (float32 in, float32 out)."""
    return (weight * (x * inv_rms).to(IN_DTYPE).to(tl.float32)).to(OUT_DTYPE).to(tl.float32)


@triton.jit
def rotated(normed, partner, cos, signed_sin, OUT_DTYPE: tl.constexpr):
    """RoPE of one column given its rotate_half partner: normed * cos + partner * signed_sin
    (signed_sin = -sin in the first half), each product and the sum rounded to OUT_DTYPE as the
    reference rounds them (returned in float32)."""
    return (normed * cos).to(OUT_DTYPE).to(tl.float32) + (partner * signed_sin).to(OUT_DTYPE).to(tl.float32)


@triton.jit
def mrope_cos_sin_columns(
    positions_ptr,  # the token's (t, h, w) positions, `stride_positions_axis` apart
    stride_positions_axis,
    inv_freq_ptr,  # [D/2] float32
    freq_cols,  # frequency index of each column (a column c of a head and c + D/2 share one)
    freq_mask,
    DTYPE: tl.constexpr,  # cos and sin are rounded to it, as transformers casts them
    SECTION_H: tl.constexpr,  # mrope_section[1]
    SECTION_W: tl.constexpr,  # mrope_section[2]
):
    """Interleaved MRoPE's cos and sin (float32, rounded to DTYPE) of one token at `freq_cols`:
    frequencies 1, 4, 7, ... below 3 * SECTION_H turn with the h position, 2, 5, 8, ... below
    3 * SECTION_W with the w position, the others with t."""
    position_t = tl.load(positions_ptr)
    position_h = tl.load(positions_ptr + stride_positions_axis)
    position_w = tl.load(positions_ptr + 2 * stride_positions_axis)
    takes_h = (freq_cols % 3 == 1) & (freq_cols < 3 * SECTION_H)
    takes_w = (freq_cols % 3 == 2) & (freq_cols < 3 * SECTION_W)
    position = tl.where(takes_h, position_h, tl.where(takes_w, position_w, position_t))
    inv_freq = tl.load(inv_freq_ptr + freq_cols, mask=freq_mask, other=0.0)
    angle = position.to(tl.float32) * inv_freq
    return tl.cos(angle).to(DTYPE).to(tl.float32), tl.sin(angle).to(DTYPE).to(tl.float32)


# step-sized arguments: one compiled variant whatever the step (kernels/jit/__init__.py)
@triton.jit(do_not_specialize=["stride_positions_axis"])
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
    half_cols = tl.arange(0, BLOCK_HALF)
    half_mask = half_cols < HEAD_DIM // 2
    cos, sin = mrope_cos_sin_columns(positions_ptr + token * stride_positions_token, stride_positions_axis,
                                     inv_freq_ptr, half_cols, half_mask, q_ptr.dtype.element_ty, SECTION_H,
                                     SECTION_W)  # [BLOCK_HALF]
    cos = cos[None, :]
    sin = sin[None, :]

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


@triton.jit
def load_normed_rotated(
    row_ptrs,  # [R, 1] each head's first column
    row_mask,  # [R, 1]
    weight_ptr,  # [D]
    cos,  # [1, BLOCK_D] float32 (`mrope_cos_sin_columns` of each column's frequency)
    signed_sin,  # [1, BLOCK_D] float32, -sin in a head's first half
    dims,  # [BLOCK_D]
    eps,
    HEAD_DIM: tl.constexpr,
):
    """Heads [R, BLOCK_D] loaded whole, each with its rotate_half partner columns, RMS-normed with
    `weight` and rotated, rounded as `qk_norm_mrope` rounds them (float32; output dtype = input's).
    For kernels that take the raw q/k of a step and would otherwise need qk_norm_mrope's launch."""
    dim_mask = dims < HEAD_DIM
    partners = (dims + HEAD_DIM // 2) % HEAD_DIM  # the column rotate_half pairs each one with
    mask = row_mask & dim_mask[None, :]
    x = tl.load(row_ptrs + dims[None, :], mask=mask, other=0.0).to(tl.float32)  # [R, BLOCK_D]
    x_partner = tl.load(row_ptrs + partners[None, :], mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]  # [R, 1]
    dtype = row_ptrs.dtype.element_ty
    weight = tl.load(weight_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    weight_partner = tl.load(weight_ptr + partners, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    normed = rms_normed(x, weight, inv_rms, dtype, dtype)
    partner = rms_normed(x_partner, weight_partner, inv_rms, dtype, dtype)
    return rotated(normed, partner, cos, signed_sin, dtype)
