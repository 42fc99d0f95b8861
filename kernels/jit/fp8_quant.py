"""FP8 helpers: `saturate_fp8` (for every kernel that writes e4m3) and the dynamic
quantization of activations, one scale per row and GROUP columns.

Grid (row blocks, column groups): a program loads a [BLOCK_ROWS, GROUP] tile,
takes each row's max |x|, and writes x / scale rounded to e4m3 plus the scales
(scale = max / 448, 1 for an all-zero group): one read of the activations and
one write of a byte per element, where the torch reference makes several float32
passes. Used before the W8A8 GEMMs, and between the two GEMMs of the fused MoE where the
gate/up kernel's tiles do not hold whole groups (else its epilogue quantizes, `quantize_rows`).
"""

import triton
import triton.language as tl

from kernels.jit.pdl import after_previous_grid


@triton.jit
def saturate_fp8(x):
    """x clamped to the float8 e4m3 range (+-448), in float32 (the cast then only rounds). A NaN
    stays NaN, as in torch's clamp: the GPU's plain max/min (`max.f32`) return the other operand."""
    x = tl.maximum(x.to(tl.float32), -448.0, propagate_nan=tl.PropagateNan.ALL)
    return tl.minimum(x, 448.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def divide_by_scale(x, scale):
    """x / scale rounded as IEEE division (`div.rn`), as torch divides, and within the e4m3 range.
    Triton's `/` is `div.full.f32` on the GPU (2 ulp), so a rare element would land one e4m3
    step away from the torch reference's."""
    return saturate_fp8(tl.div_rn(x, scale))


@triton.jit
def quantize_rows(x):
    """x [ROWS, COLS] -> (x / scale in float32 within the e4m3 range, scale [ROWS]): one group per
    row, scale = max |x| / 448 (1 for an all-zero row). Columns outside the group must be 0.
    The arithmetic of `quantize_activations_reference`; the fused MoE's gate/up epilogue
    quantizes its tiles with it too, so both give the same bits."""
    x = x.to(tl.float32)
    scale = scale_of_max(tl.max(tl.abs(x), axis=1))  # [ROWS]
    return divide_by_scale(x, scale[:, None]), scale


@triton.jit
def scale_of_max(amax):
    """The scale of a group whose largest |x| is amax: amax / 448, or 1 where that is 0 (an
    all-zero group, or float32 values below ~3e-43, whose quotient rounds to 0; x / 0 is NaN)."""
    scale = tl.div_rn(amax, 448.0)  # IEEE division, as torch's
    return tl.where(scale > 0.0, scale, 1.0)


# step-sized arguments: one compiled variant whatever the step (kernels/jit/__init__.py)
@triton.jit(do_not_specialize=["rows"])
def quantize_activations_kernel(
    # pointers
    x_ptr,  # [rows, cols]
    quantized_ptr,  # [rows, cols] e4m3 out
    scale_ptr,  # [rows, cols / GROUP] float32 out (any strides: cuBLAS wants them row-index-major)
    # sizes
    rows,
    cols,
    # strides
    stride_x_row,
    stride_quantized_row,
    stride_scale_row,
    stride_scale_group,
    # meta-parameters
    GROUP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    after_previous_grid()  # first, before any memory access (kernels/pdl.py)
    row_block = tl.program_id(0)
    group = tl.program_id(1)
    row = (row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)  # [BLOCK_ROWS]
    col = group * GROUP + tl.arange(0, GROUP)  # [GROUP]
    row_mask = row < rows
    mask = row_mask[:, None] & (col < cols)[None, :]
    x = tl.load(x_ptr + row[:, None] * stride_x_row + col[None, :], mask=mask, other=0.0)
    quantized, scale = quantize_rows(x)
    tl.store(
        quantized_ptr + row[:, None] * stride_quantized_row + col[None, :],
        quantized.to(quantized_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(scale_ptr + row * stride_scale_row + group * stride_scale_group, scale, mask=row_mask)
