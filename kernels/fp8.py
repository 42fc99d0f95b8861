"""FP8 (e4m3) block quantization: W [N, K] = Q * scale, one float32 scale per block of
`block_n x block_k` elements (the layout of Qwen's -FP8 checkpoints; the checkpoint side
is in vlm_catalog/model/fp8.py). Activations are quantized the same way with blocks of
one row (dynamic, per token and column group). The fused MoE widens such weights tile by
tile; these are the torch definitions its reference and tests use."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kernels.launch_math import cdiv, next_power_of_2
from kernels.pdl import launch_options

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0


def expanded_scale(scale: torch.Tensor, block: tuple[int, int], rows: range, cols: int) -> torch.Tensor:
    """The per-element scale of weight rows `rows` (all `cols` columns): [len(rows), cols] float32."""
    block_n, block_k = block
    row_blocks = torch.arange(rows.start, rows.stop, device=scale.device) // block_n  # [R]
    per_row = scale.float().index_select(0, row_blocks)  # [R, ceil(cols / block_k)]
    return per_row.repeat_interleave(block_k, dim=1)[:, :cols]  # [R, cols]


def dequantize(
    quantized: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype,
    first_row: int = 0,
) -> torch.Tensor:
    """W = Q * scale for Q [R, K] (rows `first_row`.. of the weight the scale belongs to),
    computed in float32 and rounded once to `dtype`."""
    rows = range(first_row, first_row + quantized.shape[0])
    return (quantized.float() * expanded_scale(scale, block, rows, quantized.shape[1])).to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (Q [N, K] e4m3, scale [ceil(N/bn), ceil(K/bk)] float32), scale = max|W| / 448
    per block, so the block's largest element maps to +-448 (a block whose quotient is 0, all zeros
    or float32 subnormals, gets scale 1)."""
    block_n, block_k = block
    rows, cols = weight.shape
    padded = weight.float().new_zeros(-(-rows // block_n) * block_n, -(-cols // block_k) * block_k)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(padded.shape[0] // block_n, block_n, padded.shape[1] // block_k, block_k)  # [Nb, bn, Kb, bk]
    amax = tiles.abs().amax(dim=(1, 3))  # [Nb, Kb]
    # divided by a tensor: torch on CUDA multiplies by the reciprocal of a Python scalar divisor,
    # which is not the IEEE quotient the Triton quantizers compute (`tl.div_rn`), for half the scales
    scale = amax / amax.new_full((), FP8_MAX)
    # an all-zero block, or one so small (float32 below ~3e-43) that its quotient rounds to 0: scale 1
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized.view(padded.shape)[:rows, :cols].contiguous(), scale


def requantize(
    quantized: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], new_block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 weight Q [N, K] with `block` scales -> the same weight with `new_block` scales: widened
    to float32 (exact) and quantized again."""
    return quantize(dequantize(quantized, scale, block, torch.float32), new_block)


def quantize_experts(weights: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert weights [E, N, K] -> (Q [E, N, K] e4m3, scales [E, N/bn, K/bk]), one expert at a
    time (the float32 temporaries stay one expert's size)."""
    pairs = [quantize(expert, block) for expert in weights]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def quantize_activations(
    values: torch.Tensor, group: int, quantized: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 activations: x [T, K] -> (Q [T, K] e4m3, scale [T, ceil(K/group)] float32),
    one scale per token and `group` consecutive columns (max |x| / 448, 1 for an all-zero group),
    as vLLM and SGLang quantize the inputs of block-FP8 GEMMs. The Triton kernel on CUDA
    (`kernels/jit/fp8_quant.py`, a power-of-two group), this torch reference elsewhere: the same
    bits. Into `quantized` and `scale` (any strides) when given, new row-major tensors otherwise."""
    from kernels.dispatch import use_triton

    if (use_triton(values, op="quantize_activations") and kernels_take_group(group, values.shape[-1])
            and values.stride(-1) == 1):
        return quantize_activations_triton(values, group, quantized, scale)
    reference_quantized, reference_scale = quantize_activations_reference(values, group)
    if quantized is None or scale is None:
        return reference_quantized, reference_scale
    quantized.copy_(reference_quantized)
    scale.copy_(reference_scale)
    return quantized, scale


def kernels_take_group(group: int, cols: int) -> bool:
    """Whether the Triton kernels that quantize activations (`quantize_activations_kernel`, the norms'
    epilogue) take one scale per `group` of `cols` columns: one group per row at any width (they
    widen it to a power of two), or a power-of-two group."""
    return group >= cols or group & (group - 1) == 0


def quantize_activations_triton(
    values: torch.Tensor, group: int, quantized: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activations` on the Triton kernel, into `quantized` [T, K] (unit column stride)
    and `scale` [T, ceil(K/group)] (any strides) when given, new row-major tensors otherwise."""
    from kernels.jit.fp8_quant import quantize_activations_kernel

    rows, cols = values.shape
    if group >= cols:  # one group per row (per-token scales): a power-of-two tile over the row alone
        group = max(16, next_power_of_2(cols))
    if quantized is None:
        quantized = torch.empty((rows, cols), dtype=FP8_DTYPE, device=values.device)
    if scale is None:
        scale = torch.empty((rows, -(-cols // group)), dtype=torch.float32, device=values.device)
    if rows == 0:
        return quantized, scale
    block_rows = max(1, min(32, 4096 // group))
    quantize_activations_kernel[(cdiv(rows, block_rows), scale.shape[1])](
        values, quantized, scale, rows, cols, values.stride(0), quantized.stride(0), scale.stride(0), scale.stride(1),
        GROUP=group, BLOCK_ROWS=block_rows, num_warps=4,
        **launch_options(values),
    )
    return quantized, scale


def quantize_activations_reference(values: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block quantization with blocks of one row and `group` columns."""
    return quantize(values, (1, group))


def dequantize_activations(quantized: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """Q * scale in float32, the inverse of `quantize_activations` up to its rounding."""
    return dequantize(quantized, scale, (1, group), torch.float32)


def gemm_input(values: torch.Tensor, group: int, fp8_activations: bool) -> torch.Tensor:
    """A GEMM's input in float32 as the references see it: as it is, or after FP8 quantization
    per row and `group` columns (what the W8A8 kernels multiply)."""
    if not fp8_activations:
        return values.float()
    return dequantize_activations(*quantize_activations_reference(values, group), group)


def per_channel_block(*reductions: int) -> tuple[int, int]:
    """The block shape of per-channel FP8 weights: one row by at least every reduction size in
    `reductions` (a power of two), so that one block spans each GEMM's whole K. The weights get
    one scale per output row, and `quantize_activations` with this group one scale per token
    (the usual "FP8 dynamic" recipe); the fused MoE then scales once, after its K loop."""
    longest = max(reductions)
    return 1, 1 << max(longest - 1, 15).bit_length()  # at least 16 (the tl.dot minimum)


def spans_reduction(quant_block_k: int, reduction: int) -> bool:
    """Whether one scale block spans a GEMM's whole reduction (per-channel weights): its scales
    are then constant along K and multiply the GEMM's sums once, after the K loop."""
    return quant_block_k >= reduction


def fp8_k_loop(block_size_k: int, quant_block_k: int, reduction: int) -> tuple[int, bool]:
    """(K step, scale after the loop) of a GEMM over FP8 weights reducing `reduction` columns.
    Where one scale block spans the whole reduction (`spans_reduction`) the configured step
    stands; otherwise `fp8_block_k`."""
    if spans_reduction(quant_block_k, reduction):
        return block_size_k, True
    return fp8_block_k(block_size_k, quant_block_k), False


def imprecise_accumulation(block_size_k: int) -> int | None:
    """`max_num_imprecise_acc` for the FP8 x FP8 `tl.dot`s that carry their sum across the whole
    K loop (scales after the loop, per-channel W8A8): how many products the tensor core may sum
    in its own accumulator before the sum is added into float32.

    An H100's FP8 wgmma keeps fewer bits than float32 in that accumulator (DeepSeek-V3's report
    measured about 14), and Triton's sm_90 default lets it run over the whole reduction. On an
    H100 (2026-11-27) the per-channel W8A8 fused MoE at T=4096 was then 2.4-4.0e-2 of max
    |expected| from the reference, over four inputs, against 1.0-1.4e-2 for 128 x 128 block
    scales, whose GEMMs add each K step's product into float32 anyway
    (docs/results/gpu/fp8_moe_reproducibility.txt). BLOCK_K promotes the sum every K step
    (128 products, DeepSeek-V3's interval, at the FP8 tiles' K step). None, Triton's default,
    where ``VLM_CATALOG_FP8_FAST_ACCUMULATION`` asks for speed over those bits."""
    from kernels.dispatch import fp8_fast_accumulation

    return None if fp8_fast_accumulation() else block_size_k


DOWN_INPUT_GROUP = 128  # per-channel experts' down-GEMM input: one scale per token and 128 columns


def down_input_group(block_shape: tuple[int, int], intermediate: int) -> int:
    """The column group of the fused MoE's down-GEMM input under FP8 activations: one scale per
    token and this many of the I columns (`quantize_activations`).

    Block-scaled experts: the weights' block width, as every W8A8 GEMM input. Per-channel experts
    (one block spans I): `DOWN_INPUT_GROUP`, where I is wider, unless
    VLM_CATALOG_FP8_FAST_ACCUMULATION keeps the sums in the tensor core across the whole K loop;
    there, and where I is no wider, one scale per token.

    Why 128 columns for per-channel experts: their down GEMM adds each K step's product into
    float32 anyway (`imprecise_accumulation`), so a K step can as well scale it by its own
    columns' activation scale, at no cost in the loop. Then the gate/up kernel, whose tile
    holds the whole group (BLOCK_N = 128, the prefill configs), quantizes its own output in its
    epilogue, and the [T*K, I] product never makes a 16-bit round trip through memory: about
    100 us per layer of a 16k-token step, where a separate launch read 201 MB and wrote 100 MB
    (kernels/jit/fused_moe.py). The scales are also finer than one per token."""
    from kernels.dispatch import fp8_fast_accumulation

    quant_k = block_shape[1]
    if spans_reduction(quant_k, intermediate) and intermediate > DOWN_INPUT_GROUP and not fp8_fast_accumulation():
        return DOWN_INPUT_GROUP
    return quant_k


def fp8_block_k(block_size_k: int, quant_block_k: int) -> int:
    """The K step of a GEMM over FP8 weights (fused MoE, dense linear): a power of two dividing
    the scale block (one scale per step), at most the configured step and at least 16 (the
    tl.dot minimum)."""
    if quant_block_k % 16:  # 8 passed the halving below as a step of 8, which no tl.dot takes
        raise ValueError(f"FP8 weights: the scale block's K size {quant_block_k} must be a multiple of 16")
    step = min(block_size_k, 1 << (quant_block_k.bit_length() - 1))  # a power of two (tl.arange)
    while quant_block_k % step and step > 16:
        step //= 2
    return step


def gpu_block_k_problem(quant_block_k: int, reductions: Iterable[int]) -> str | None:
    """Why GEMMs over FP8 weights with this scale block K, reducing these widths, cannot run on
    the GPU (`fp8_k_loop`), or None. Asked when the model is built: before, such a checkpoint
    loaded, and its first forward on the GPU raised."""
    for reduction in reductions:
        try:
            fp8_k_loop(16, quant_block_k, reduction)
        except ValueError:
            return (f"needs the FP8 scale block's K size (weight_block_size[1], {quant_block_k}) to be a multiple "
                    f"of 16 on the GPU, or at least the width its GEMM reduces ({reduction})")
    return None
