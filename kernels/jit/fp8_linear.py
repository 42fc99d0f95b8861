"""The dense block-FP8 GEMM: out [M, N] = x [M, K] @ W [N, K]^T (+ bias).

W is float8 e4m3 with one float32 scale per QUANT_N x QUANT_K block (Qwen's
-FP8 layout, kernels/fp8.py). Programs are ordered GROUP_M M blocks at a time
(`grouped_tile`, the fused MoE's order) so neighbouring programs share W tiles
in L2. BLOCK_K divides QUANT_K, so each K step lies in one scale block: its
partial product is multiplied by its columns' scales and accumulated in fp32.

FP8_ACTIVATIONS: x is e4m3 too, quantized per row and QUANT_K columns with its
own float32 scales (`quantize_activations`); both dot operands are FP8 (the
Hopper FP8 tensor cores) and each K step is scaled by the rows' and the
columns' scales. Otherwise each W tile is widened to x's dtype after its load
(exact; to bf16 on a GPU by inline PTX, jit/fp8_widen.py) and the dot runs in
x's dtype.

SCALE_AFTER_LOOP: one scale block spans the whole reduction (QUANT_K >= K:
per-channel weights, per-token activations), so the loop accumulates the raw
products with `tl.dot(x, w, acc)` and the scales multiply the sums once after
it, which keeps Hopper's wgmma chain asynchronous (jit/fused_moe.py, whose GEMMs
do the same). With FP8_ACTIVATIONS the sum is added into float32 every
IMPRECISE_ACC_K products (`kernels.fp8.imprecise_accumulation`), as there.

The result is rounded once to the output dtype after the bias is added in
fp32, as cuBLAS does in its epilogue.
"""

import triton
import triton.language as tl

from kernels.jit.block_scales import column_scales
from kernels.jit.fp8_widen import widen_e4m3
from kernels.jit.fused_moe import grouped_tile
from kernels.jit.pdl import after_previous_grid


@triton.jit
def fp8_linear_kernel(
    # pointers
    x_ptr,  # [M, K] (e4m3 with FP8_ACTIVATIONS)
    x_scale_ptr,  # [M, K / QUANT_K] float32 (FP8_ACTIVATIONS only)
    w_ptr,  # [N, K] e4m3
    w_scale_ptr,  # [N / QUANT_N, K / QUANT_K] float32
    bias_ptr,  # [N] (HAS_BIAS only)
    out_ptr,  # [M, N] out
    # sizes
    num_rows,  # M
    out_features,  # N
    in_features,  # K: the reduction
    # strides
    stride_x_row,
    stride_x_scale_row,
    stride_w_row,
    stride_w_scale_row,
    stride_out_row,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8_ACTIVATIONS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QUANT_N: tl.constexpr,
    QUANT_K: tl.constexpr,
    WIDEN_WITH_PTX: tl.constexpr,  # on a GPU: widen the weights to bf16 by inline PTX (jit/fp8_widen.py)
    SCALE_AFTER_LOOP: tl.constexpr,  # QUANT_K >= in_features: scales applied once (module doc)
    IMPRECISE_ACC_K: tl.constexpr,  # SCALE_AFTER_LOOP FP8 x FP8: products summed before float32 (module doc)
):
    after_previous_grid()  # first, before any memory access (kernels/pdl.py)
    m_block, n_block = grouped_tile(
        tl.program_id(0), tl.cdiv(num_rows, BLOCK_M), tl.cdiv(out_features, BLOCK_N), GROUP_M
    )
    rows = (m_block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < num_rows
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < out_features
    ks = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + rows[:, None] * stride_x_row + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_w_row + ks[:, None]  # [BLOCK_K, BLOCK_N]
    n_start = n_block * BLOCK_N
    x_scale_ptrs = x_scale_ptr + rows * stride_x_scale_row  # [BLOCK_M] (FP8_ACTIVATIONS)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, in_features, BLOCK_K):
        k_mask = ks < in_features - k_start
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if SCALE_AFTER_LOOP and FP8_ACTIVATIONS:
            acc = tl.dot(x, w, acc, max_num_imprecise_acc=IMPRECISE_ACC_K)
        elif SCALE_AFTER_LOOP:
            acc = tl.dot(x, widen_e4m3(w, x.dtype, WIDEN_WITH_PTX), acc, input_precision=DOT_PRECISION)
        else:
            k_block = k_start // QUANT_K
            w_scale = column_scales(w_scale_ptr, n_start, cols, col_mask, k_block, stride_w_scale_row,
                                    BLOCK_N, QUANT_N)  # a scalar or [1, BLOCK_N]
            if FP8_ACTIVATIONS:
                x_scale = tl.load(x_scale_ptrs + k_block, mask=row_mask, other=0.0)[:, None]  # [BLOCK_M, 1]
                acc += tl.dot(x, w) * (x_scale * w_scale)
            else:
                acc += tl.dot(x, widen_e4m3(w, x.dtype, WIDEN_WITH_PTX), input_precision=DOT_PRECISION) * w_scale
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SCALE_AFTER_LOOP:  # one scale block along K: its scales multiply the whole sums
        factor = column_scales(w_scale_ptr, n_start, cols, col_mask, 0, stride_w_scale_row,
                               BLOCK_N, QUANT_N)  # a scalar or [1, BLOCK_N]
        if FP8_ACTIVATIONS:
            factor = tl.load(x_scale_ptrs, mask=row_mask, other=0.0)[:, None] * factor  # [BLOCK_M, 1] x the columns'
        acc = acc * factor

    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_out_row + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
