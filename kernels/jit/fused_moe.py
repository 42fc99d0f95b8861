"""The two grouped GEMMs of the fused MoE.

Both kernels share the layout produced by `moe_align_block_size`: M block m
holds BLOCK_M entries of ``sorted_token_ids`` (flat pair indices t * K + k, or
T*K for padding), all routed to expert ``expert_ids[m]``. Programs are ordered
in groups of GROUP_M M blocks (the Triton matmul tutorial's L2 swizzle) and
return at once past ``num_tokens_post_padded``.

Rounding points follow the torch reference: each GEMM result is rounded to the
activation dtype, silu's result too, then the products. The roundings go through
`round_through` (jit/rounding.py), not `.to(dtype).to(tl.float32)`: with Triton 3.9
(and 3.6 for float16) the latter let LLVM turn the products into 16-bit multiplies
of accumulator registers, and ptxas then serialized the K loop's wgmma at prefill
tiles.

FP8_WEIGHTS: the expert weights are float8 e4m3 with one float32 scale per
QUANT_N x QUANT_K block. Each weight tile is widened to the activation dtype
after its load (exact; to bf16 on a GPU by inline PTX, jit/fp8_widen.py), each
K step's partial product is multiplied by the scales of its columns (BLOCK_K
divides QUANT_K, so a step lies in one scale block) and then accumulated. Where a tile's columns lie in one scale block
(QUANT_N a multiple of BLOCK_N) that is one scalar per step, folded into the
rows' factor (jit/block_scales.py): in the sm_90 SASS of the W8A8 GEMMs at
T=8192 this took the loop from 278 to 167 instructions (gate/up) and 178 to
112 (down) on Triton 3.6, from a per-column load and multiply per element.

FP8_ACTIVATIONS (with FP8_WEIGHTS): the A operand is FP8 too, quantized per row
and QUANT_K columns with its own float32 scales; both operands go to the dot
as FP8 and the K step's product is scaled by the rows' and the columns' scales.

SCALE_AFTER_LOOP (with FP8_WEIGHTS): the whole reduction is one scale block
(QUANT_K >= K: per-channel weights, and per-token activations with
FP8_ACTIVATIONS), so the scales do not change along K. The loop then
accumulates the raw products with `tl.dot(a, b, acc)`, as the 16-bit GEMMs do,
and the scales multiply the accumulator once after it. Scaling each step's
product needs that product finished: in the sm_90 SASS every K step of the
block-scaled W8A8 GEMMs waits for its wgmma (`WARPGROUP.DEPBAR.LE gsb0, 0x0`)
before the next is issued; with the scales after the loop the wgmma chain stays
asynchronous. FP8 x FP8 dots (FP8_ACTIVATIONS) there add their sum into float32
every IMPRECISE_ACC_K products (`kernels.fp8.imprecise_accumulation`: BLOCK_K, so
once per K step, as the block-scaled GEMMs' sums are); None leaves it in the tensor
core's own accumulator, with fewer bits than float32, across the whole loop, as
vLLM's per-channel FP8 MoE does.

The down GEMM's FP8 input has one scale per row and ACT_GROUP columns: QUANT_K for
block scales; for per-channel experts 128 (`kernels.fp8.down_input_group`), unless fast
accumulation keeps one scale per row. With groups narrower than I (ACT_SCALES_IN_LOOP)
each K step's product, already added into float32 every step, is scaled by its rows'
group scale first, and the weights' scales still multiply once after the loop.
QUANTIZE_OUT (gate/up, BLOCK_N = ACT_GROUP, or one tile spanning I): the epilogue writes
the product as that input, e4m3 with its rows' scale for the tile (`quantize_rows`, the
arithmetic of the activation quantizer), instead of 16-bit values for a separate launch
to read back and quantize.

PERSISTENT (the down GEMM on the prefill tiles, kernels/moe/fused_moe.py
`down_runs_persistent`): a grid of one program per SM, each walking tiles
pid, pid + programs, ... of the M blocks in use (read from the device, so the
launch needs no sync) in one `tl.range(..., flatten=True)` loop over all their
K steps. The pipeliner then issues the next tile's loads during the current
tile's last steps and its epilogue, which sits in a branch of the flattened loop,
taken once per tile. In the sm_90 SASS (Triton 3.6, T=16384, 128 x 128 x 128,
4 stages) a K step's path is about 225 instructions against 181, in 250
registers and 160 KiB of shared memory against 214 and 128 KiB: one program per
SM either way. The next grid may launch once every tile is done, where one
program per tile lets it launch before its epilogue.
"""

import triton
import triton.language as tl

from kernels.jit.block_scales import column_scales
from kernels.jit.fp8_quant import quantize_rows
from kernels.jit.fp8_widen import widen_e4m3
from kernels.jit.pdl import let_next_grid_launch, wait_for_previous_grid
from kernels.jit.rounding import round_through


@triton.jit
def grouped_tile(pid, num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
    """Program id -> (M block, N block), GROUP_M M blocks at a time (also the dense FP8 GEMM's order)."""
    programs_per_group = GROUP_M * num_n_blocks
    group = pid // programs_per_group
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    m_block = first_m + (pid % programs_per_group) % group_size
    n_block = (pid % programs_per_group) // group_size
    return m_block, n_block


# step-sized arguments: one compiled variant whatever the step (kernels/jit/__init__.py)
@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def moe_gate_up_silu_kernel(
    # pointers
    hidden_ptr,  # [T, H] (e4m3 with FP8_ACTIVATIONS)
    hidden_scale_ptr,  # [T, H / QUANT_K] float32 (FP8_ACTIVATIONS only)
    w13_ptr,  # [E, 2I, H]: rows 0..I-1 gate, I..2I-1 up
    w13_scale_ptr,  # [E, 2I / QUANT_N, H / QUANT_K] float32 (FP8_WEIGHTS only)
    activated_ptr,  # [T*K, I] out: silu(gate) * up per pair (e4m3 with QUANTIZE_OUT)
    activated_scale_ptr,  # [T*K, ceil(I / BLOCK_N)] float32 out (QUANTIZE_OUT only)
    sorted_token_ids_ptr,  # [num_m_blocks * BLOCK_M] int32
    expert_ids_ptr,  # [num_m_blocks] int32
    num_tokens_post_padded_ptr,  # [1] int32
    # sizes
    num_pairs,  # T*K
    top_k,
    hidden_size,  # H: the reduction
    intermediate,  # I: the output width
    num_m_blocks,
    # strides
    stride_hidden_token,
    stride_hidden_scale_token,
    stride_w13_expert,
    stride_w13_row,
    stride_w13_scale_expert,
    stride_w13_scale_row,
    stride_activated_pair,
    stride_activated_scale_pair,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8_WEIGHTS: tl.constexpr,
    FP8_ACTIVATIONS: tl.constexpr,
    QUANT_N: tl.constexpr,
    QUANT_K: tl.constexpr,
    WIDEN_WITH_PTX: tl.constexpr,  # FP8_WEIGHTS on a GPU: widen to bf16 by inline PTX (jit/fp8_widen.py)
    SCALE_AFTER_LOOP: tl.constexpr,  # FP8_WEIGHTS with QUANT_K >= hidden_size: scales applied once (module doc)
    IMPRECISE_ACC_K: tl.constexpr,  # SCALE_AFTER_LOOP FP8 x FP8: products summed before float32 (module doc)
    QUANTIZE_OUT: tl.constexpr,  # write the product as the down GEMM's FP8 input, one group per tile (module doc)
    OUT_DTYPE: tl.constexpr,  # the hidden states' dtype: the GEMM results, silu and the product round to it
):
    wait_for_previous_grid()  # first, before any memory access; the next grid launches after the main loop (kernels/jit/pdl.py)
    m_block, n_block = grouped_tile(
        tl.program_id(0), num_m_blocks, tl.cdiv(intermediate, BLOCK_N), GROUP_M
    )
    if m_block * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + m_block).to(tl.int64)

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_token_ids_ptr + rows)  # [BLOCK_M]
    pair_mask = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)  # gate/up row within the expert
    col_mask = cols < intermediate
    ks = tl.arange(0, BLOCK_K)

    a_ptrs = hidden_ptr + tokens[:, None] * stride_hidden_token + ks[None, :]  # [BLOCK_M, BLOCK_K]
    gate_ptrs = (
        w13_ptr + expert * stride_w13_expert + cols[None, :] * stride_w13_row + ks[:, None]
    )  # [BLOCK_K, BLOCK_N]
    up_ptrs = gate_ptrs + intermediate * stride_w13_row
    # FP8: the expert's gate and up scale rows; the K block advances in the loop
    gate_scales_ptr = w13_scale_ptr + expert * stride_w13_scale_expert
    up_scales_ptr = gate_scales_ptr + (intermediate // QUANT_N) * stride_w13_scale_row
    n_start = n_block * BLOCK_N
    gate_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, hidden_size, BLOCK_K):
        k_mask = ks < hidden_size - k_start
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        gate_w = tl.load(gate_ptrs, mask=w_mask, other=0.0)
        up_w = tl.load(up_ptrs, mask=w_mask, other=0.0)
        if FP8_WEIGHTS and not SCALE_AFTER_LOOP:
            k_block = k_start // QUANT_K
            gate_scale = column_scales(gate_scales_ptr, n_start, cols, col_mask, k_block, stride_w13_scale_row,
                                       BLOCK_N, QUANT_N)  # a scalar or [1, BLOCK_N]
            up_scale = column_scales(up_scales_ptr, n_start, cols, col_mask, k_block, stride_w13_scale_row,
                                     BLOCK_N, QUANT_N)
            if FP8_ACTIVATIONS:
                a_scale = tl.load(
                    hidden_scale_ptr + tokens * stride_hidden_scale_token + k_block, mask=pair_mask, other=0.0
                )[:, None]  # [BLOCK_M, 1]
                gate_acc += tl.dot(a, gate_w) * (a_scale * gate_scale)
                up_acc += tl.dot(a, up_w) * (a_scale * up_scale)
            else:
                gate_part = tl.dot(a, widen_e4m3(gate_w, a.dtype, WIDEN_WITH_PTX), input_precision=DOT_PRECISION)
                up_part = tl.dot(a, widen_e4m3(up_w, a.dtype, WIDEN_WITH_PTX), input_precision=DOT_PRECISION)
                gate_acc += gate_part * gate_scale
                up_acc += up_part * up_scale
        elif FP8_ACTIVATIONS:  # scales after the loop
            gate_acc = tl.dot(a, gate_w, gate_acc, max_num_imprecise_acc=IMPRECISE_ACC_K)
            up_acc = tl.dot(a, up_w, up_acc, max_num_imprecise_acc=IMPRECISE_ACC_K)
        elif FP8_WEIGHTS:  # scales after the loop
            gate_acc = tl.dot(a, widen_e4m3(gate_w, a.dtype, WIDEN_WITH_PTX), gate_acc, input_precision=DOT_PRECISION)
            up_acc = tl.dot(a, widen_e4m3(up_w, a.dtype, WIDEN_WITH_PTX), up_acc, input_precision=DOT_PRECISION)
        else:
            gate_acc = tl.dot(a, gate_w, gate_acc, input_precision=DOT_PRECISION)
            up_acc = tl.dot(a, up_w, up_acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    let_next_grid_launch()  # the main loop is done: the next grid may launch (kernels/jit/pdl.py)
    if SCALE_AFTER_LOOP:  # one scale block along K: its scales multiply the whole sums
        gate_factor = column_scales(gate_scales_ptr, n_start, cols, col_mask, 0, stride_w13_scale_row,
                                    BLOCK_N, QUANT_N)  # a scalar or [1, BLOCK_N]
        up_factor = column_scales(up_scales_ptr, n_start, cols, col_mask, 0, stride_w13_scale_row,
                                  BLOCK_N, QUANT_N)
        if FP8_ACTIVATIONS:
            a_scale = tl.load(hidden_scale_ptr + tokens * stride_hidden_scale_token, mask=pair_mask,
                              other=0.0)[:, None]  # [BLOCK_M, 1]
            gate_factor = a_scale * gate_factor
            up_factor = a_scale * up_factor
        gate_acc = gate_acc * gate_factor
        up_acc = up_acc * up_factor

    dtype = OUT_DTYPE
    gate = round_through(gate_acc, dtype)
    up = round_through(up_acc, dtype)
    silu = round_through(gate * tl.sigmoid(gate), dtype)
    activated = (silu * up).to(dtype)
    out_ptrs = activated_ptr + pairs[:, None].to(tl.int64) * stride_activated_pair + cols[None, :]
    if QUANTIZE_OUT:  # the tile's columns are one group of the down GEMM's input: its rows' scales here
        quantized, scale = quantize_rows(activated)  # [BLOCK_M, BLOCK_N] e4m3 range, [BLOCK_M]
        tl.store(out_ptrs, quantized.to(activated_ptr.dtype.element_ty), mask=pair_mask[:, None] & col_mask[None, :])
        tl.store(activated_scale_ptr + pairs.to(tl.int64) * stride_activated_scale_pair + n_block, scale,
                 mask=pair_mask)
    else:
        tl.store(out_ptrs, activated, mask=pair_mask[:, None] & col_mask[None, :])


# step-sized arguments: one compiled variant whatever the step (kernels/jit/__init__.py)
@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def moe_down_kernel(
    # pointers
    activated_ptr,  # [T*K, I] (e4m3 with FP8_ACTIVATIONS)
    activated_scale_ptr,  # [T*K, I / ACT_GROUP] float32 (FP8_ACTIVATIONS only)
    w2_ptr,  # [E, H, I]
    w2_scale_ptr,  # [E, H / QUANT_N, I / QUANT_K] float32 (FP8_WEIGHTS only)
    topk_weights_ptr,  # [T*K], any float dtype
    pair_out_ptr,  # [T*K, H] out: weighted expert output per pair
    sorted_token_ids_ptr,  # [num_m_blocks * BLOCK_M] int32
    expert_ids_ptr,  # [num_m_blocks] int32
    num_tokens_post_padded_ptr,  # [1] int32
    # sizes
    num_pairs,  # T*K
    intermediate,  # I: the reduction
    hidden_size,  # H: the output width
    num_m_blocks,
    # strides
    stride_activated_pair,
    stride_activated_scale_pair,
    stride_w2_expert,
    stride_w2_row,
    stride_w2_scale_expert,
    stride_w2_scale_row,
    stride_topk_weights,
    stride_pair_out_pair,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8_WEIGHTS: tl.constexpr,
    FP8_ACTIVATIONS: tl.constexpr,
    QUANT_N: tl.constexpr,
    QUANT_K: tl.constexpr,
    WIDEN_WITH_PTX: tl.constexpr,  # FP8_WEIGHTS on a GPU: widen to bf16 by inline PTX (jit/fp8_widen.py)
    SCALE_AFTER_LOOP: tl.constexpr,  # FP8_WEIGHTS with QUANT_K >= intermediate: scales applied once (module doc)
    IMPRECISE_ACC_K: tl.constexpr,  # SCALE_AFTER_LOOP FP8 x FP8: products summed before float32 (module doc)
    ACT_GROUP: tl.constexpr,  # FP8_ACTIVATIONS: the input's columns per scale (QUANT_K, or less: module doc)
    ACT_SCALES_IN_LOOP: tl.constexpr,  # SCALE_AFTER_LOOP FP8_ACTIVATIONS with groups narrower than I (module doc)
    PERSISTENT: tl.constexpr,  # each program walks tiles in one flattened loop (module doc)
):
    wait_for_previous_grid()  # first, before any memory access; the next grid launches after the main loop (kernels/jit/pdl.py)
    num_n_blocks = tl.cdiv(hidden_size, BLOCK_N)
    if PERSISTENT:  # the M blocks in use, known on the device; this program's tiles, one loop over all their K steps
        used_m_blocks = tl.cdiv(tl.load(num_tokens_post_padded_ptr), BLOCK_M)
        for tile in tl.range(tl.program_id(0), used_m_blocks * num_n_blocks, tl.num_programs(0), flatten=True):
            m_block, n_block = grouped_tile(tile, used_m_blocks, num_n_blocks, GROUP_M)
            acc, pairs, pair_mask, cols, col_mask, scales_ptr = down_tile_sums(
                m_block, n_block, activated_ptr, activated_scale_ptr, w2_ptr, w2_scale_ptr, sorted_token_ids_ptr,
                expert_ids_ptr, num_pairs, intermediate, hidden_size, stride_activated_pair,
                stride_activated_scale_pair, stride_w2_expert, stride_w2_row, stride_w2_scale_expert,
                stride_w2_scale_row, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, FP8_WEIGHTS, FP8_ACTIVATIONS, QUANT_N,
                QUANT_K, WIDEN_WITH_PTX, SCALE_AFTER_LOOP, IMPRECISE_ACC_K, ACT_GROUP, ACT_SCALES_IN_LOOP)
            store_down_tile(acc, activated_scale_ptr, scales_ptr, topk_weights_ptr, pair_out_ptr, pairs, pair_mask,
                            cols, col_mask, n_block * BLOCK_N, stride_activated_scale_pair, stride_w2_scale_row,
                            stride_topk_weights, stride_pair_out_pair, BLOCK_N, QUANT_N, FP8_ACTIVATIONS,
                            SCALE_AFTER_LOOP, ACT_SCALES_IN_LOOP)
    else:  # one tile per program
        m_block, n_block = grouped_tile(tl.program_id(0), num_m_blocks, num_n_blocks, GROUP_M)
        if m_block * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
            return
        acc, pairs, pair_mask, cols, col_mask, scales_ptr = down_tile_sums(
            m_block, n_block, activated_ptr, activated_scale_ptr, w2_ptr, w2_scale_ptr, sorted_token_ids_ptr,
            expert_ids_ptr, num_pairs, intermediate, hidden_size, stride_activated_pair, stride_activated_scale_pair,
            stride_w2_expert, stride_w2_row, stride_w2_scale_expert, stride_w2_scale_row, BLOCK_M, BLOCK_N, BLOCK_K,
            DOT_PRECISION, FP8_WEIGHTS, FP8_ACTIVATIONS, QUANT_N, QUANT_K, WIDEN_WITH_PTX, SCALE_AFTER_LOOP,
            IMPRECISE_ACC_K, ACT_GROUP, ACT_SCALES_IN_LOOP)
    let_next_grid_launch()  # the main loop is done (every tile's, PERSISTENT): the next grid may launch (kernels/jit/pdl.py)
    if not PERSISTENT:  # the tile's epilogue overlaps the next grid's launch
        store_down_tile(acc, activated_scale_ptr, scales_ptr, topk_weights_ptr, pair_out_ptr, pairs, pair_mask, cols,
                        col_mask, n_block * BLOCK_N, stride_activated_scale_pair, stride_w2_scale_row,
                        stride_topk_weights, stride_pair_out_pair, BLOCK_N, QUANT_N, FP8_ACTIVATIONS,
                        SCALE_AFTER_LOOP, ACT_SCALES_IN_LOOP)


@triton.jit
def down_tile_sums(
    m_block, n_block, activated_ptr, activated_scale_ptr, w2_ptr, w2_scale_ptr, sorted_token_ids_ptr, expert_ids_ptr,
    num_pairs, intermediate, hidden_size, stride_activated_pair, stride_activated_scale_pair, stride_w2_expert,
    stride_w2_row, stride_w2_scale_expert, stride_w2_scale_row,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8_WEIGHTS: tl.constexpr, FP8_ACTIVATIONS: tl.constexpr, QUANT_N: tl.constexpr, QUANT_K: tl.constexpr,
    WIDEN_WITH_PTX: tl.constexpr, SCALE_AFTER_LOOP: tl.constexpr, IMPRECISE_ACC_K: tl.constexpr,
    ACT_GROUP: tl.constexpr, ACT_SCALES_IN_LOOP: tl.constexpr,
):
    """A down tile's K loop: its sums [BLOCK_M, BLOCK_N] (the scales left for after the loop not yet
    applied), its pairs (flat indices t * K + k, T*K for padding) and output columns with their
    masks, and its expert's weight scale rows, for `store_down_tile`."""
    expert = tl.load(expert_ids_ptr + m_block).to(tl.int64)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_token_ids_ptr + rows).to(tl.int64)  # [BLOCK_M]
    pair_mask = pairs < num_pairs
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)  # output hidden column
    col_mask = cols < hidden_size
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = activated_ptr + pairs[:, None] * stride_activated_pair + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w2_ptr + expert * stride_w2_expert + cols[None, :] * stride_w2_row + ks[:, None]  # [BLOCK_K, BLOCK_N]
    scales_ptr = w2_scale_ptr + expert * stride_w2_scale_expert  # the expert's scale rows
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, intermediate, BLOCK_K):
        acc = down_k_step(acc, a_ptrs, w_ptrs, k_start, activated_scale_ptr, scales_ptr, pairs, pair_mask, cols,
                          col_mask, n_block * BLOCK_N, intermediate, stride_activated_scale_pair, stride_w2_scale_row,
                          BLOCK_N, BLOCK_K, DOT_PRECISION, FP8_WEIGHTS, FP8_ACTIVATIONS, QUANT_N, QUANT_K,
                          WIDEN_WITH_PTX, SCALE_AFTER_LOOP, IMPRECISE_ACC_K, ACT_GROUP, ACT_SCALES_IN_LOOP)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc, pairs, pair_mask, cols, col_mask, scales_ptr


@triton.jit
def down_k_step(
    acc, a_ptrs, w_ptrs, k_start, activated_scale_ptr, scales_ptr, pairs, pair_mask, cols, col_mask, n_start,
    intermediate, stride_activated_scale_pair, stride_w2_scale_row,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8_WEIGHTS: tl.constexpr,
    FP8_ACTIVATIONS: tl.constexpr, QUANT_N: tl.constexpr, QUANT_K: tl.constexpr, WIDEN_WITH_PTX: tl.constexpr,
    SCALE_AFTER_LOOP: tl.constexpr, IMPRECISE_ACC_K: tl.constexpr, ACT_GROUP: tl.constexpr,
    ACT_SCALES_IN_LOOP: tl.constexpr,
):
    """`acc` with the down GEMM's K step from `k_start` added (`a_ptrs`, `w_ptrs` at that step)."""
    ks = tl.arange(0, BLOCK_K)
    k_mask = ks < intermediate - k_start
    a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
    w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
    if FP8_WEIGHTS and not SCALE_AFTER_LOOP:
        scale = column_scales(scales_ptr, n_start, cols, col_mask, k_start // QUANT_K, stride_w2_scale_row,
                              BLOCK_N, QUANT_N)  # a scalar or [1, BLOCK_N]
        if FP8_ACTIVATIONS:
            a_scale = tl.load(
                activated_scale_ptr + pairs * stride_activated_scale_pair + k_start // ACT_GROUP,
                mask=pair_mask, other=0.0,
            )[:, None]  # [BLOCK_M, 1]
            acc += tl.dot(a, w) * (a_scale * scale)
        else:
            acc += tl.dot(a, widen_e4m3(w, a.dtype, WIDEN_WITH_PTX), input_precision=DOT_PRECISION) * scale
    elif FP8_ACTIVATIONS and ACT_SCALES_IN_LOOP:  # the weights' scales after the loop, the rows' here
        a_scale = tl.load(
            activated_scale_ptr + pairs * stride_activated_scale_pair + k_start // ACT_GROUP,
            mask=pair_mask, other=0.0,
        )[:, None]  # [BLOCK_M, 1]
        acc += tl.dot(a, w, max_num_imprecise_acc=IMPRECISE_ACC_K) * a_scale
    elif FP8_ACTIVATIONS:  # scales after the loop
        acc = tl.dot(a, w, acc, max_num_imprecise_acc=IMPRECISE_ACC_K)
    elif FP8_WEIGHTS:  # scales after the loop
        acc = tl.dot(a, widen_e4m3(w, a.dtype, WIDEN_WITH_PTX), acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def store_down_tile(
    acc, activated_scale_ptr, scales_ptr, topk_weights_ptr, pair_out_ptr, pairs, pair_mask, cols, col_mask, n_start,
    stride_activated_scale_pair, stride_w2_scale_row, stride_topk_weights, stride_pair_out_pair,
    BLOCK_N: tl.constexpr, QUANT_N: tl.constexpr, FP8_ACTIVATIONS: tl.constexpr, SCALE_AFTER_LOOP: tl.constexpr,
    ACT_SCALES_IN_LOOP: tl.constexpr,
):
    """The down tile's epilogue: the scales left for after the K loop, the routing weight, the
    round to the hidden dtype, the store of each pair's weighted expert output."""
    if SCALE_AFTER_LOOP:  # one scale block along K: its scales multiply the whole sums
        factor = column_scales(scales_ptr, n_start, cols, col_mask, 0, stride_w2_scale_row,
                               BLOCK_N, QUANT_N)  # a scalar or [1, BLOCK_N]
        if FP8_ACTIVATIONS and not ACT_SCALES_IN_LOOP:  # one scale per row: here too
            factor = tl.load(activated_scale_ptr + pairs * stride_activated_scale_pair, mask=pair_mask,
                             other=0.0)[:, None] * factor  # [BLOCK_M, 1] x the columns'
        acc = acc * factor

    dtype = pair_out_ptr.dtype.element_ty
    routing_weight = tl.load(
        topk_weights_ptr + pairs * stride_topk_weights, mask=pair_mask, other=0.0
    )
    routing_weight = routing_weight.to(dtype).to(tl.float32)  # multiplied in the hidden dtype
    weighted = round_through(acc, dtype) * routing_weight[:, None]
    out_ptrs = pair_out_ptr + pairs[:, None] * stride_pair_out_pair + cols[None, :]
    tl.store(out_ptrs, weighted.to(dtype), mask=pair_mask[:, None] & col_mask[None, :])
