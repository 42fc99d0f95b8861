"""Weight scales of block-quantized FP8 GEMMs (one float32 per QUANT_N x QUANT_K block)."""

import triton
import triton.language as tl


@triton.jit
def column_scales(scale_rows_ptr, n_start, cols, col_mask, k_block, stride_scale_row,
                  BLOCK_N: tl.constexpr, QUANT_N: tl.constexpr):
    """The scales of a tile's columns `cols` (from `n_start`) at K block `k_block`, as a factor of
    the tile's [BLOCK_M, BLOCK_N] product: one scalar where the tile lies inside one QUANT_N block
    (QUANT_N a multiple of BLOCK_N: one load, and the scale folds into the rows' factor), else a
    [1, BLOCK_N] row. `scale_rows_ptr`: the weight's [N / QUANT_N, K / QUANT_K] scales."""
    if QUANT_N % BLOCK_N == 0:
        return tl.load(scale_rows_ptr + (n_start // QUANT_N) * stride_scale_row + k_block)
    else:
        scales = tl.load(scale_rows_ptr + (cols // QUANT_N) * stride_scale_row + k_block, mask=col_mask, other=0.0)
        return scales[None, :]  # [1, BLOCK_N]
