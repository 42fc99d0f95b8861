"""RMSNorm kernel (optionally fused with the residual add, and with the sum of several terms
before it: the fused MoE's weighted expert outputs, or rows gathered from the grouped-GEMM
MoE's output and weighted here); one program per row. With QUANTIZE it also writes the next
W8A8 GEMM's FP8 input (kernels/fp8_input.py): its output rounded to the 16-bit dtype, then
quantized per GROUP columns as `quantize_activations_kernel` quantizes it."""

import triton
import triton.language as tl

from kernels.jit.fp8_quant import divide_by_scale, scale_of_max
from kernels.jit.pdl import after_previous_grid


# step-sized arguments: one compiled variant whatever the step (kernels/jit/__init__.py)
@triton.jit(do_not_specialize=["num_rows"])
def rms_norm_kernel(
    # pointers
    x_ptr,  # [T, H], or [T, NUM_TERMS, H] terms summed first, or GATHER_TERMS: values [R, H]
    residual_ptr,  # [T, H], read only when ADD_RESIDUAL
    weight_ptr,  # [H]
    out_ptr,  # [T, H] of OUT_DTYPE, written only when WRITE_OUT
    new_residual_ptr,  # [T, H], written only when ADD_RESIDUAL
    term_rows_ptr,  # [T, NUM_TERMS] rows of x_ptr, read only when GATHER_TERMS
    term_weights_ptr,  # [T, NUM_TERMS] each row's factor, read only when GATHER_TERMS
    quantized_ptr,  # [grid rows, H] e4m3, written only when QUANTIZE
    scale_ptr,  # [grid rows, ceil(H / GROUP)] float32 (any strides), written only when QUANTIZE
    # sizes
    num_rows,  # T: rows past it (padding programs, QUANTIZE only) read nothing and write zeros
    hidden_size,
    eps,
    # strides
    stride_x_row,
    stride_x_term,
    stride_residual_row,
    stride_out_row,
    stride_new_residual_row,
    stride_quantized_row,
    stride_scale_row,
    stride_scale_group,
    # meta-parameters
    BLOCK_SIZE: tl.constexpr,  # next power of two >= hidden_size
    ADD_RESIDUAL: tl.constexpr,
    NUM_TERMS: tl.constexpr,  # 1: x is the row itself
    GATHER_TERMS: tl.constexpr,  # term k of row t: x[term_rows[t, k]] * term_weights[t, k]
    OUT_DTYPE: tl.constexpr,  # the output's dtype, which QUANTIZE rounds to too
    WRITE_OUT: tl.constexpr,  # the 16-bit output (False: only its FP8 form, QUANTIZE)
    QUANTIZE: tl.constexpr,
    GROUP: tl.constexpr,  # columns per scale, a power of two dividing BLOCK_SIZE (BLOCK_SIZE: one per row)
):
    after_previous_grid()  # first, before any memory access (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    # a padding row (QUANTIZE) reads and writes no column of x, so its output is 0
    mask = cols < tl.where(row < num_rows, hidden_size, 0)

    if GATHER_TERMS:
        x = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
        term_row = tl.minimum(row, num_rows - 1)  # a padding row reads the last row's terms, masked below
        for term in tl.static_range(NUM_TERMS):
            source = tl.load(term_rows_ptr + term_row * NUM_TERMS + term).to(tl.int64)
            factor = tl.load(term_weights_ptr + term_row * NUM_TERMS + term).to(tl.float32)
            value = tl.load(x_ptr + source * stride_x_row + cols, mask=mask, other=0.0).to(tl.float32)
            # each weighted term rounded to the input dtype, as a 16-bit `values * weights` is
            x += (value * factor).to(x_ptr.dtype.element_ty).to(tl.float32)
        x = x.to(x_ptr.dtype.element_ty).to(tl.float32)  # summed in float32, rounded once
    else:
        x = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if NUM_TERMS > 1 and not GATHER_TERMS:
        for term in tl.static_range(1, NUM_TERMS):
            x += tl.load(x_ptr + row * stride_x_row + term * stride_x_term + cols, mask=mask, other=0.0).to(tl.float32)
        # summed in float32 and rounded once, as torch's sum over the terms is
        x = x.to(x_ptr.dtype.element_ty).to(tl.float32)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual_row + cols, mask=mask, other=0.0)
        # the new residual is rounded to the input dtype, as torch's `x + residual` is
        x = (x + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_new_residual_row + cols, x, mask=mask)
        x = x.to(tl.float32)

    variance = tl.sum(x * x, axis=0) / hidden_size
    normed = (x * tl.math.rsqrt(variance + eps)).to(
        x_ptr.dtype.element_ty
    )  # cast before the weight
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = (weight * normed.to(tl.float32)).to(OUT_DTYPE)
    if WRITE_OUT:
        tl.store(out_ptr + row * stride_out_row + cols, out, mask=mask)
    if QUANTIZE:
        # `quantize_rows`' arithmetic: each group's scale from the rounded output in groups
        # ([BLOCK_SIZE] -> [BLOCK_SIZE / GROUP, GROUP]; the columns past hidden_size and a padding
        # row's are 0, which a zero group's scale of 1 needs), then the row divided and stored as
        # the vector it is. Stored from the [groups, GROUP] shape, Triton 3.6 went through shared
        # memory and wrote one byte per store (tests/kernels/test_sm90_compile.py).
        x = out.to(tl.float32)
        scale = scale_of_max(tl.max(tl.abs(tl.reshape(x, [BLOCK_SIZE // GROUP, GROUP])), axis=1))  # [BLOCK_SIZE / GROUP]
        column_scale = tl.reshape(tl.broadcast_to(scale[:, None], [BLOCK_SIZE // GROUP, GROUP]), [BLOCK_SIZE])
        tl.store(quantized_ptr + row * stride_quantized_row + cols,
                 divide_by_scale(x, column_scale).to(quantized_ptr.dtype.element_ty), mask=cols < hidden_size)
        group_index = tl.arange(0, BLOCK_SIZE // GROUP)
        tl.store(scale_ptr + row * stride_scale_row + group_index * stride_scale_group, scale,
                 mask=group_index * GROUP < hidden_size)
