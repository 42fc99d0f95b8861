"""silu(gate) * up; grid = (tokens, column blocks)."""

import triton
import triton.language as tl


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
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < intermediate
    row = x_ptr + token * stride_x_token
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    activated = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)  # rounded like torch's F.silu
    tl.store(out_ptr + token * stride_out_token + cols, (activated * up).to(dtype), mask=mask)
