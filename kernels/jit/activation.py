"""silu(gate) * up; grid = (tokens, column blocks). And the same quantized to FP8 with one
scale per token (`silu_and_mul_quantize_kernel`; grid = (tokens,), a row per program)."""

import triton
import triton.language as tl

from kernels.jit.fp8_quant import divide_by_scale, scale_of_max
from kernels.jit.pdl import after_previous_grid


@triton.jit
def silu_times_up(row, cols, mask, intermediate, dtype: tl.constexpr):
    """silu(gate) * up of one token's columns `cols` (gate = row[:I], up = row[I:]), rounded
    to `dtype` as torch rounds F.silu's result and the product; returned in float32."""
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    activated = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)  # rounded like torch's F.silu
    return (activated * up).to(dtype).to(tl.float32)


@triton.jit
def silu_and_mul_kernel(
    # pointers
    x_ptr,  # [T, 2I]: gate = x[:, :I], up = x[:, I:]
    out_ptr,  # [T, I]
    # sizes
    intermediate,
    # strides
    stride_x_token,
    stride_out_token,
    # meta-parameters
    BLOCK_SIZE: tl.constexpr,
):
    after_previous_grid()  # first, before any memory access (kernels/pdl.py)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < intermediate
    dtype = out_ptr.dtype.element_ty
    product = silu_times_up(x_ptr + token * stride_x_token, cols, mask, intermediate, dtype)
    tl.store(out_ptr + token * stride_out_token + cols, product.to(dtype), mask=mask)


@triton.jit
def silu_and_mul_quantize_kernel(
    # pointers
    x_ptr,  # [T, 2I]: gate = x[:, :I], up = x[:, I:]
    quantized_ptr,  # [T, I] e4m3 out
    scale_ptr,  # [T] float32 out: max |silu(gate) * up| / 448 (1 for an all-zero row)
    # sizes
    intermediate,
    # strides
    stride_x_token,
    stride_quantized_token,
    # meta-parameters
    BLOCK_SIZE: tl.constexpr,  # next power of two >= intermediate: the whole row in one program
):
    after_previous_grid()  # first, before any memory access (kernels/pdl.py)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < intermediate
    # what silu_and_mul writes, quantized as written
    product = silu_times_up(x_ptr + token * stride_x_token, cols, mask, intermediate, x_ptr.dtype.element_ty)
    amax = tl.max(tl.where(mask, tl.abs(product), 0.0), axis=0)
    scale = scale_of_max(amax)
    quantized = divide_by_scale(product, scale)
    tl.store(quantized_ptr + token * stride_quantized_token + cols, quantized.to(quantized_ptr.dtype.element_ty),
             mask=mask)
    tl.store(scale_ptr + token, scale)
