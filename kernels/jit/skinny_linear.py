"""x @ W.T for a few rows of x: a decode step's dense projections at small batches.

Program p owns output columns [p * BLOCK_N, (p + 1) * BLOCK_N) for every row and walks K in
BLOCK_K steps. The rows are padded to BLOCK_M = 16 for `tl.dot` (masked loads, nothing read
past M), so the weight tiles feed a dot and Triton's software pipeline keeps NUM_STAGES of
them in flight: the kernel streams the weight once, at a few KiB per program per step.

With PREFETCH_WEIGHT (a launch with programmatic dependent launch, kernels/pdl.py) each program
first asks for its weight rows into L2 (kernels/jit/l2_prefetch.py), before it waits for the
grid before it: the weight is no grid's output, and it streams in while that grid finishes.
"""

import triton
import triton.language as tl

from kernels.jit.l2_prefetch import prefetch_rows_to_l2
from kernels.jit.pdl import let_next_grid_launch, wait_for_previous_grid


@triton.jit
def skinny_linear_kernel(
    # pointers
    x_ptr,  # [M, K]
    weight_ptr,  # [N, K]
    bias_ptr,  # [N], read only when HAS_BIAS
    out_ptr,  # [M, N]
    # sizes
    num_rows,
    num_cols,
    reduction,
    # strides
    stride_x_row,
    stride_weight_row,
    stride_out_row,
    # meta-parameters
    BLOCK_M: tl.constexpr,  # >= M, >= 16 for tl.dot
    BLOCK_N: tl.constexpr,  # output columns per program
    BLOCK_K: tl.constexpr,  # reduction step
    HAS_BIAS: tl.constexpr,
    PREFETCH_WEIGHT: tl.constexpr,  # ask for the program's weight rows into L2 before the wait
    LINE_ELEMENTS: tl.constexpr,  # weight elements per 128-byte line
    PREFETCH_LINES: tl.constexpr,  # lines of each row per prefetch step
):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH_WEIGHT:  # read-only, no grid's output: asked for while the grid before still runs
        prefetch_rows_to_l2(weight_ptr + tl.minimum(cols, num_cols - 1)[:, None].to(tl.int64) * stride_weight_row,
                            reduction, LINE_ELEMENTS, PREFETCH_LINES)
    wait_for_previous_grid()  # before any other memory access; the next grid launches after the main loop (kernels/jit/pdl.py)
    row_mask = rows < num_rows
    col_mask = cols < num_cols
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x_row  # [BLOCK_M, 1]
    weight_rows = weight_ptr + cols[:, None].to(tl.int64) * stride_weight_row  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, reduction, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < reduction
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        weight = tl.load(weight_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :],
                         other=0.0)  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, tl.trans(weight), acc)  # [BLOCK_M, BLOCK_N], float32 sums
    let_next_grid_launch()  # the main loop is done: the next grid may launch (kernels/jit/pdl.py)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out_row + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
