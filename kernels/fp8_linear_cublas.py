"""The W8A8 FP8 dense GEMM through cuBLAS (`torch.nn.functional.scaled_mm`), on Hopper: with
128-wide block scales, or per-channel (row-wise) ones.

On the H100 the Triton block-FP8 GEMM (kernels/fp8_linear.py) ran at 0.35-0.74x
of bf16 cuBLAS at the decoder's q/k/v and o shapes (docs/benchmarks.md), so
W8A8 dense projections cost time instead of saving it. cuBLASLt (12.9 and
later) has block-scaled FP8 GEMMs for sm_90 in exactly our W8A8 recipe, the
one of Qwen's and DeepSeek's FP8 checkpoints: one activation scale per row and
128 columns ("1x128"), one weight scale per 128 x 128 block. torch 2.10 and
later expose them as `F.scaled_mm(..., BlockWise1x128, ..., BlockWise128x128)`.

The operands, as torch checks them (`_check_scaled_mm_sizes_v2` in
torch/_meta_registrations.py; `tests/kernels/test_fp8_linear_cublas.py` runs
those checks on CPU):
- a: the activations quantized by our kernel, [M4, K] e4m3 row-major, M4 = M
  rounded up to a multiple of 4 (cuBLASLt's requirement, which torch does not
  check); the padding rows are zeros with scale 1;
- scale_a: [M4, ceil(K/128)] float32 with strides (1, M4) (row index fastest);
- b: W^T, [K, N] column-major (W [N, K] as stored);
- scale_b: [L4, ceil(N/128)] float32 with strides (1, L4): the weight's scales
  transposed, their K side zero-padded to L4 = ceil(K/128) rounded up to 4.
Scales are dequantization multipliers (real = fp8 x scale), as ours are. No
fast accumulation (cuBLAS refuses it with block scales): fp32 accumulation and
one rounding to x's dtype, the Triton kernel's contract, so the same tolerance
against `fp8_linear_reference` holds.

Per-channel weights (blocks of one row spanning K, `kernels.fp8.per_channel_block`,
`--quantization fp8_w8a8_channel`) take the row-wise recipe: a [M4, K] with
scale_a [M4, 1] (one per token, unit strides: torch checks them), b as above with scale_b [1, N] (one per weight
row), `ScalingType.RowWise` for both, and no fast accumulation unless
VLM_CATALOG_FP8_FAST_ACCUMULATION asks for it, as the Triton kernel accumulates
such GEMMs (kernels/jit/fp8_linear.py, `kernels.fp8.imprecise_accumulation`).

When it runs (`usable`): x on a CUDA device of compute capability 9.x, torch
with block-wise `F.scaled_mm`, 128 x 128 or per-channel weight blocks, K and N
multiples of 16, x in bf16 or fp16, and not turned off
(`VLM_CATALOG_KERNELS_OFF=fp8_linear_cublas`).
The first call for each (device, weight shape, dtype, recipe) checks it against the
reference on PROBE_ROWS rows (so with padding); an error or a mismatch logs a
warning and that shape keeps the Triton kernel. While a CUDA graph is being
captured an unchecked shape takes the Triton kernel for that call (the check
reads results on the host); the engine's start-up runs every shape before its
capture, so in practice none is unchecked then.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels.checks import dtype_name
from kernels.dispatch import fp8_fast_accumulation, kernels_off
from kernels.first_call_check import faster_path_agrees
from kernels.fp8 import quantize_activations, spans_reduction
from kernels.fp8_input import Fp8Input, Fp8InputLayout, empty_fp8_input, fill_padding

logger = logging.getLogger(__name__)

CUBLAS_BLOCK = (128, 128)  # the only weight blocks cuBLAS's block-scaled FP8 GEMM takes
CUBLAS_DTYPES = (torch.bfloat16, torch.float16)
ROW_MULTIPLE = 4  # cuBLASLt's row alignment for the 1x128 scales
PROBE_ROWS = 6  # the check's rows: not a multiple of ROW_MULTIPLE, so the padding is checked too
PROBE_TOLERANCE = 1e-2  # of max |reference|: x's rounding (bf16: 2^-8) plus accumulation order
OFF_SWITCH = "fp8_linear_cublas"  # the name VLM_CATALOG_KERNELS_OFF takes

# the first-call check's verdict per (device, weight shape, x's dtype, weight block)
_checked: dict[tuple[torch.device, tuple[int, int], torch.dtype, tuple[int, int]], bool] = {}


@functools.cache
def device_supported(device: torch.device) -> bool:
    """A Hopper GPU (compute capability 9.x) and a torch with block-wise `F.scaled_mm`."""
    scaling = getattr(F, "ScalingType", None)
    if device.type != "cuda" or not hasattr(F, "scaled_mm") or not hasattr(scaling, "BlockWise128x128"):
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


def row_wise(block: tuple[int, int], in_features: int) -> bool:
    """Per-channel weights: blocks of one row spanning the whole reduction (one scale per row)."""
    return block[0] == 1 and spans_reduction(block[1], in_features)


def eligible(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether the operands are of a kind the cuBLAS GEMM takes (before the first-call check)."""
    out_features, in_features = weight.shape
    return (
        (tuple(block) == CUBLAS_BLOCK or row_wise(block, in_features))
        and x.dtype in CUBLAS_DTYPES
        and in_features % 16 == 0
        and out_features % 16 == 0
        and OFF_SWITCH not in kernels_off()
        and device_supported(x.device)
    )


def usable(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int]) -> bool:
    """`eligible`, and the first-call check passed for this shape (module doc)."""
    if not eligible(x, weight, block):
        return False
    key = (x.device, tuple(weight.shape), x.dtype, tuple(block), _fast_accumulation(block, weight.shape[1]))
    verdict = _checked.get(key)
    if verdict is None:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return False  # checked outside a capture, on a later call
        verdict = _checked[key] = _matches_reference(x.dtype, weight, weight_scale, tuple(block))
    return verdict


def verdicts() -> dict[str, bool]:
    """The first-call checks of this process so far: for each weight shape, x's dtype and recipe
    ("(N, K) bfloat16 block" or "... row-wise"), whether cuBLAS runs it (False: the Triton kernel).
    `bench_gpu.py` records them with each engine phase."""
    return {_describe(shape, dtype, block, fast): verdict for (_, shape, dtype, block, fast), verdict in _checked.items()}


def _describe(weight_shape: tuple[int, int], dtype: torch.dtype, block: tuple[int, int], fast: bool) -> str:
    recipe = "row-wise" if row_wise(block, weight_shape[1]) else "block"
    return f"{tuple(weight_shape)} {dtype_name(dtype)} {recipe}{', fast accumulation' if fast else ''}"


def _fast_accumulation(block: tuple[int, int], in_features: int) -> bool:
    """`use_fast_accum` for this recipe: row-wise GEMMs sum in the tensor core across K only under
    VLM_CATALOG_FP8_FAST_ACCUMULATION, as the Triton kernel does (`kernels.fp8.imprecise_accumulation`);
    cuBLAS refuses fast accumulation with block scales."""
    return row_wise(block, in_features) and fp8_fast_accumulation()


def _matches_reference(dtype: torch.dtype, weight: torch.Tensor, weight_scale: torch.Tensor,
                       block: tuple[int, int]) -> bool:
    from kernels.fp8_linear import fp8_linear_reference

    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(PROBE_ROWS, weight.shape[1], generator=generator).to(weight.device, dtype)  # [rows, K]
    shape = _describe(tuple(weight.shape), dtype, block, _fast_accumulation(block, weight.shape[1]))
    return faster_path_agrees(
        f"cuBLAS FP8 GEMM for weight {shape}", lambda: fp8_linear_cublas(probe, weight, weight_scale, block=block),
        lambda: fp8_linear_reference(probe, weight, weight_scale, block, fp8_activations=True), PROBE_TOLERANCE,
        logger, against="the reference", replaced="the Triton kernel")


def input_layout(block: tuple[int, int], in_features: int) -> Fp8InputLayout:
    """The FP8 input the GEMM takes (module doc): rows padded to ROW_MULTIPLE; one scale per token
    (row-wise: [M4, 1], unit strides) or per token and 128 columns ([M4, Kb], row index fastest)."""
    if row_wise(block, in_features):
        return Fp8InputLayout(group=in_features, row_multiple=ROW_MULTIPLE)
    return Fp8InputLayout(group=block[1], row_multiple=ROW_MULTIPLE, scales_row_index_fastest=True)


def cublas_operands(
    flat: torch.Tensor | Sequence[torch.Tensor] | Fp8Input, weight: torch.Tensor, weight_scale: torch.Tensor,
    block: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, scale_a, b, scale_b) for `F.scaled_mm` from x [M, K] and W [N, K] with its scales
    [ceil(N/128), ceil(K/128)] (per-channel: [N, 1]), laid out as the module doc says. x may
    come as consecutive pieces of its rows ([M_i, K], unit column stride): each is quantized
    into its rows of `a` where it lies, so x is never stacked in 16 bits. Or x comes quantized
    already, in `input_layout` (an `Fp8Input` the norm before the GEMM wrote): `a` and `scale_a`
    are its values and scales."""
    in_features = weight.shape[1]
    layout = input_layout(block, in_features)
    if isinstance(flat, Fp8Input):
        _check_fp8_input(flat, layout)
        quantized, scale = flat.values, flat.scale
    else:
        pieces = [flat] if isinstance(flat, torch.Tensor) else list(flat)
        rows = sum(piece.shape[0] for piece in pieces)
        quantized, scale = empty_fp8_input(rows, in_features, layout, pieces[0].device)  # [M4, K], [M4, G]
        fill_padding(quantized, scale, rows)
        start = 0
        for piece in pieces:
            end = start + piece.shape[0]
            quantize_activations(piece, layout.group, quantized[start:end], scale[start:end])
            start = end
    if row_wise(block, in_features):
        return quantized, scale, weight.t(), weight_scale.t()  # scale_a [M4, 1], b [K, N], scale_b [1, N]
    k_blocks = weight_scale.shape[1]
    padded_k_blocks = -(-k_blocks // 4) * 4
    if padded_k_blocks > k_blocks:
        weight_scale = F.pad(weight_scale, (0, padded_k_blocks - k_blocks))  # [Nb, L4]
    return quantized, scale, weight.t(), weight_scale.t()  # b [K, N], scale_b [L4, Nb]


def _check_fp8_input(x: Fp8Input, layout: Fp8InputLayout) -> None:
    """A quantized input must be in the layout this GEMM asked for (a writer's bug otherwise)."""
    padded = layout.padded_rows(x.rows)
    expected_strides = (1, padded) if layout.scales_row_index_fastest else (layout.num_groups(x.shape[1]), 1)
    if (x.group != layout.group or x.values.shape[0] != padded or x.scale.shape[0] != padded
            or (layout.num_groups(x.shape[1]) > 1 and x.scale.stride() != expected_strides)):
        raise ValueError(f"x: an FP8 input of group {x.group}, values {tuple(x.values.shape)} and scales "
                         f"{tuple(x.scale.shape)} with strides {x.scale.stride()}, where cuBLAS takes {layout}")


def fp8_linear_cublas(
    x: torch.Tensor | Sequence[torch.Tensor] | Fp8Input, weight: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None, *, block: tuple[int, int],
) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: W8A8 with 1x128 / 128x128 scales on cuBLAS, or
    row-wise ones for per-channel weights (`row_wise`). x may be consecutive pieces of its rows
    ([M_i, K] each, `cublas_operands`), or [M, K] quantized already in `input_layout`: then
    [M, N] (in the dtype the quantized rows were rounded from)."""
    out_features, in_features = weight.shape
    if isinstance(x, Fp8Input):
        if x.rows == 0:
            return torch.empty((0, out_features), dtype=x.dtype, device=x.device)
        return _scaled_mm(x, x.rows, x.dtype, (x.rows, out_features), weight, weight_scale, bias, block)
    if isinstance(x, torch.Tensor):
        pieces, out_shape = [x.reshape(-1, in_features)], (*x.shape[:-1], out_features)  # [M, K]
    else:  # consecutive row pieces [M_i, K] of x [M, K]
        pieces, out_shape = list(x), (sum(piece.shape[0] for piece in x), out_features)
    pieces = [piece if piece.stride(-1) == 1 else piece.contiguous() for piece in pieces]
    dtype, rows = pieces[0].dtype, sum(piece.shape[0] for piece in pieces)
    if rows == 0:
        return pieces[0].new_empty(out_shape)
    return _scaled_mm(pieces, rows, dtype, out_shape, weight, weight_scale, bias, block)


def _scaled_mm(
    x: Sequence[torch.Tensor] | Fp8Input, rows: int, dtype: torch.dtype, out_shape: tuple[int, ...],
    weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, block: tuple[int, int],
) -> torch.Tensor:
    """`F.scaled_mm` on x's operands (`cublas_operands`): [rows, N] in `dtype`, viewed as `out_shape`."""
    in_features = weight.shape[1]
    a, scale_a, b, scale_b = cublas_operands(x, weight, weight_scale, block)
    scaling = F.ScalingType
    if row_wise(block, in_features):
        recipe_a, recipe_b = scaling.RowWise, scaling.RowWise
    else:
        recipe_a, recipe_b = scaling.BlockWise1x128, scaling.BlockWise128x128
    out = F.scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=dtype,
                      use_fast_accum=_fast_accumulation(block, in_features))[:rows]  # [M, N]
    if bias is not None:  # added in float32 as the reference does (one more rounding)
        out = (out.float() + bias.float()).to(dtype)
    return out.view(*out_shape)  # [..., N]
