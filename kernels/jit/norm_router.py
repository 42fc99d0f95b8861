"""The post-attention residual add, RMSNorm and MoE router logits of a decode batch in one launch.

Program p computes the router logits of experts [p * BLOCK_E, (p + 1) * BLOCK_E) for every
token. Each program first norms every token's row itself (a few KiB per row, read from L2),
so none waits for another; program 0 alone stores the new residual and the normed rows.
The arithmetic is `rms_norm_kernel`'s with ADD_RESIDUAL (kernels/jit/rms_norm.py), and the
logits are the normed rows (as stored, in the hidden dtype) times the router weight, summed
in float32 and rounded once to the hidden dtype, as a 16-bit `F.linear` does.
"""

import triton
import triton.language as tl

from kernels.jit.pdl import after_previous_grid


@triton.jit
def _rounded_sum_chunk(x_ptr, residual_ptr, tokens, cols, mask, stride_x_row, stride_residual_row):
    """(x + residual)[tokens, cols] rounded to x's dtype, as float32 [BLOCK_T, BLOCK_H]."""
    rows = tokens[:, None].to(tl.int64)
    x = tl.load(x_ptr + rows * stride_x_row + cols[None, :], mask=mask, other=0.0)
    residual = tl.load(residual_ptr + rows * stride_residual_row + cols[None, :], mask=mask, other=0.0)
    return (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def add_rms_norm_router_kernel(
    # pointers
    x_ptr,  # [T, H] the attention block's output
    residual_ptr,  # [T, H]
    norm_weight_ptr,  # [H]
    gate_weight_ptr,  # [E, H] the router
    normed_ptr,  # [T, H] out (program 0)
    new_residual_ptr,  # [T, H] out (program 0): x + residual
    logits_ptr,  # [T, E] out: this program's experts
    # sizes
    num_tokens,
    hidden_size,
    num_experts,
    eps,
    # strides
    stride_x_row,
    stride_residual_row,
    stride_normed_row,
    stride_new_residual_row,
    stride_gate_row,
    stride_logits_row,
    # meta-parameters
    BLOCK_T: tl.constexpr,  # next power of two >= num_tokens: every token in one tile
    BLOCK_E: tl.constexpr,  # experts per program
    BLOCK_H: tl.constexpr,  # hidden columns per step of the two passes
):
    after_previous_grid()  # first, before any memory access (kernels/pdl.py)
    program = tl.program_id(0)
    tokens = tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens

    # pass 1: each row's mean square, of the sum as rounded to the input dtype
    squares = tl.zeros([BLOCK_T], dtype=tl.float32)
    for start in range(0, hidden_size, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        mask = token_mask[:, None] & (cols < hidden_size)[None, :]
        hidden = _rounded_sum_chunk(x_ptr, residual_ptr, tokens, cols, mask, stride_x_row, stride_residual_row)
        squares += tl.sum(hidden * hidden, axis=1)
    inverse_rms = tl.math.rsqrt(squares / hidden_size + eps)  # [BLOCK_T]

    # pass 2: the normed rows, and their products with this program's router rows
    experts = program * BLOCK_E + tl.arange(0, BLOCK_E)
    expert_mask = experts < num_experts
    logits = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for start in range(0, hidden_size, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        col_mask = cols < hidden_size
        mask = token_mask[:, None] & col_mask[None, :]
        hidden = _rounded_sum_chunk(x_ptr, residual_ptr, tokens, cols, mask, stride_x_row, stride_residual_row)
        # cast back to the input dtype before the weight, as transformers' RMSNorm
        scaled = (hidden * inverse_rms[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
        norm_weight = tl.load(norm_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        normed = (scaled * norm_weight[None, :]).to(normed_ptr.dtype.element_ty)  # [BLOCK_T, BLOCK_H]
        if program == 0:
            rows = tokens[:, None].to(tl.int64)
            tl.store(new_residual_ptr + rows * stride_new_residual_row + cols[None, :],
                     hidden.to(new_residual_ptr.dtype.element_ty), mask=mask)
            tl.store(normed_ptr + rows * stride_normed_row + cols[None, :], normed, mask=mask)
        gate = tl.load(
            gate_weight_ptr + experts[:, None].to(tl.int64) * stride_gate_row + cols[None, :],
            mask=expert_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_E, BLOCK_H]
        # [BLOCK_T, 1, BLOCK_H] * [1, BLOCK_E, BLOCK_H] summed over H -> [BLOCK_T, BLOCK_E]
        logits += tl.sum(normed.to(tl.float32)[:, None, :] * gate[None, :, :], axis=2)

    tl.store(
        logits_ptr + tokens[:, None].to(tl.int64) * stride_logits_row + experts[None, :],
        logits.to(logits_ptr.dtype.element_ty),
        mask=token_mask[:, None] & expert_mask[None, :],
    )
