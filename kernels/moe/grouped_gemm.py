"""Fused MoE on torch's grouped GEMMs (CUTLASS on Hopper), for prefill-sized token counts.

    pairs (t, k) sorted by expert (a stable argsort of topk_ids: no host sync)
    rows      = hidden[token of each sorted pair]                [P, H]   P = T*K
    gate, up  = grouped GEMM(rows, w13[e]^T per expert segment)  [P, 2I]
    activated = silu(gate) * up                                  [P, I]   (W8A8: as e4m3, in the same pass)
    down      = grouped GEMM(activated, w2[e]^T per segment)     [P, H]
    out[t]    = sum_k down[row of (t, k)] * topk_weights[t, k]   [T, H]

The Triton kernels (kernels/jit/fused_moe.py) gather the rows inside the GEMM and
apply SiLU-and-mul in its epilogue, so they move less memory; torch's grouped GEMMs
are CUTLASS's Hopper kernels, and at prefill sizes (T*K/E = 1024 rows per expert at
16k tokens) the GEMMs dominate. On the H100 of 2026-11-27 the per-channel W8A8
Triton MoE ran at 459 TFLOP/s at T=4096 (summing across K in the tensor core),
under a third of the FP8 peak. Which is faster is measured, not assumed: the kernels
phase times both (`fused_moe[..., grouped_mm]` rows), and this path runs only
where `VLM_CATALOG_MOE_GEMM=grouped_mm` asks for it.

Formats:
- bf16 experts: `torch._grouped_mm`.
- per-channel W8A8 experts (`--quantization fp8_w8a8_channel`: one scale per weight
  row, `per_channel_experts`, FP8 activations): `torch._scaled_grouped_mm` with
  row-wise scales, one per token (the rows quantized per token, `quantize_activations`;
  the down GEMM's input too, where the Triton kernels take one scale per 128 columns)
  and one per weight row; `use_fast_accum` only under VLM_CATALOG_FP8_FAST_ACCUMULATION,
  as the Triton kernels and cuBLAS's row-wise recipe accumulate.
Both round each GEMM's result to bf16 and multiply the routing weights in bf16, as
`fused_moe_reference` does; the K terms are summed in float32 and rounded once
(`sum_experts`), or left where the GEMM wrote them (`SortedExpertTerms`) for the next
RMSNorm launch to gather, weigh and sum (`gathered_sum_add_rms_norm`): the terms
[T, K, H] are then never written, which saves a write and a read of that size.

The operands, as torch checks them (`_meta_grouped_mm_common` in
torch/_meta_registrations.py; the tests run those checks on the meta device):
rows [P, H] row-major (FP8: e4m3, scale [P] float32); weights w13 [E, 2I, H] as
`w13.transpose(1, 2)`, [E, H, 2I] column-major (FP8: scale [E, 2I], the stored
[E, 2I, 1] without its last axis); `offs` [E] int32, each expert's end row; output
bf16 only.

When it runs (`grouped_gemm_wanted`): `VLM_CATALOG_MOE_GEMM=grouped_mm`, bf16 hidden
states on a CUDA device of compute capability 9.x whose torch has the op, a format
above, at least GROUPED_GEMM_MIN_TOKENS tokens, no CUDA graph being captured, and
not turned off (`VLM_CATALOG_KERNELS_OFF=moe_grouped_gemm`). The first call for each
(device, weight shapes, format) checks it against `fused_moe_reference` on its own
recipe (`per_token_down_group`) on PROBE_TOKENS tokens; an error or a mismatch logs a
warning and that shape keeps the Triton path.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from kernels.activation import silu_and_mul, silu_and_mul_quantize
from kernels.dispatch import (
    environment_choice,
    environment_variable,
    fp8_fast_accumulation,
    kernels_off,
)
from kernels.first_call_check import faster_path_agrees
from kernels.fp8 import FP8_DTYPE, quantize_activations
from kernels.moe.align import expert_counts
from kernels.rms_norm import gathered_terms_reference

logger = logging.getLogger(__name__)

MOE_GEMM_ENV_VAR = "VLM_CATALOG_MOE_GEMM"
MOE_GEMMS = ("triton", "grouped_mm")
OFF_SWITCH = "moe_grouped_gemm"  # the name VLM_CATALOG_KERNELS_OFF takes
GROUPED_GEMM_MIN_TOKENS = 1024  # prefill chunks; decode batches (at most 256) keep the Triton kernels
PROBE_TOKENS = 256
# of max |reference|: bf16 GEMMs differ in summation order only; W8A8 as the model-shape test allows
# (tests/kernels/test_fused_moe_fp8.py, W8A8_MODEL_SHAPES_TOLERANCE: an activation one bf16 unit
# apart can land one e4m3 step apart)
PROBE_TOLERANCE = {"bf16": 1e-2, "w8a8_channel": 3e-2}

# the first-call check's verdict per (device, w13 shape, w2 shape, format, fast accumulation)
_checked: dict[tuple, bool] = {}


def moe_gemm(choice: str) -> contextlib.AbstractContextManager:
    """Sets `VLM_CATALOG_MOE_GEMM` for the block (`kernels.dispatch.environment_variable`)."""
    if choice not in MOE_GEMMS:
        raise ValueError(f"unknown MoE GEMM {choice!r}: one of {', '.join(MOE_GEMMS)}")
    return environment_variable(MOE_GEMM_ENV_VAR, choice)


def moe_gemm_choice() -> str:
    """The setting of `VLM_CATALOG_MOE_GEMM` (``triton`` when unset); anything else is an error."""
    return environment_choice(MOE_GEMM_ENV_VAR, MOE_GEMMS)


def expert_format(w13: torch.Tensor, block_shape: tuple[int, int] | None, fp8_activations: bool) -> str | None:
    """"bf16", "w8a8_channel", or None for a format this path does not take (block scales, W8A16)."""
    from kernels.moe.fused_moe import per_channel_experts

    if block_shape is None:
        return "bf16" if w13.dtype == torch.bfloat16 else None
    if w13.dtype == FP8_DTYPE and fp8_activations and per_channel_experts(w13, block_shape):
        return "w8a8_channel"
    return None


def device_supported(device: torch.device, expert_kind: str) -> bool:
    """A Hopper GPU whose torch has the grouped GEMM the format needs."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    return hasattr(torch, "_scaled_grouped_mm" if expert_kind == "w8a8_channel" else "_grouped_mm")


def grouped_gemm_wanted(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
                        block_shape: tuple[int, int] | None, fp8_activations: bool) -> bool:
    """Whether `fused_moe` takes this path for this call (the module doc's conditions, and the
    first-call check for its shapes)."""
    if moe_gemm_choice() != "grouped_mm" or OFF_SWITCH in kernels_off():
        return False
    expert_kind = expert_format(w13, block_shape, fp8_activations)
    if (expert_kind is None or hidden.dtype != torch.bfloat16 or hidden.shape[0] < GROUPED_GEMM_MIN_TOKENS
            or not device_supported(hidden.device, expert_kind)):
        return False
    if hidden.device.type == "cuda" and torch.cuda.is_current_stream_capturing():  # the check syncs
        return _checked.get(_key(hidden.device, w13, w2, expert_kind), False)
    return checked(hidden.device, w13, w2, expert_kind, w13_scale, w2_scale, block_shape)


def _key(device: torch.device, w13: torch.Tensor, w2: torch.Tensor, expert_kind: str) -> tuple:
    fast = expert_kind == "w8a8_channel" and fp8_fast_accumulation()
    return device, tuple(w13.shape), tuple(w2.shape), expert_kind, fast


def checked(device: torch.device, w13: torch.Tensor, w2: torch.Tensor, expert_kind: str,
            w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
            block_shape: tuple[int, int] | None = None) -> bool:
    """The first-call check's verdict for these weights (run now if this is their first call)."""
    key = _key(device, w13, w2, expert_kind)
    if key not in _checked:
        _checked[key] = _matches_reference(w13, w2, expert_kind, w13_scale, w2_scale, block_shape)
    return _checked[key]


def verdicts() -> dict[str, bool]:
    """The first-call checks so far, by weight shapes and format (bench_gpu records them)."""
    return {f"{w13} {w2} {kind}{', fast accumulation' if fast else ''}": verdict
            for (_, w13, w2, kind, fast), verdict in _checked.items()}


def _matches_reference(w13, w2, expert_kind, w13_scale, w2_scale, block_shape) -> bool:
    """This path against `fused_moe_reference` on PROBE_TOKENS random tokens, random routing, with
    the down GEMM's input quantized per token as here (the Triton kernels quantize it in groups of
    128 columns, `kernels.fp8.down_input_group`)."""
    from kernels.moe.fused_moe import fused_moe_reference

    num_experts, _, hidden_size = w13.shape
    generator = torch.Generator().manual_seed(0)
    top_k = min(8, num_experts)
    hidden = torch.randn(PROBE_TOKENS, hidden_size, generator=generator).to(w13.device, torch.bfloat16)
    scores = torch.rand(PROBE_TOKENS, num_experts, generator=generator)
    weights, ids = scores.softmax(-1).topk(top_k, dim=-1)
    weights, ids = weights.to(w13.device), ids.to(w13.device, torch.int32)
    scales = dict(w13_scale=w13_scale, w2_scale=w2_scale, block_shape=block_shape,
                  fp8_activations=expert_kind == "w8a8_channel")
    return faster_path_agrees(
        f"grouped-GEMM MoE for experts {tuple(w13.shape)} / {tuple(w2.shape)} ({expert_kind})",
        lambda: fused_moe_grouped_gemm(hidden, w13, w2, weights, ids, **scales),
        lambda: fused_moe_reference(hidden, w13, w2, weights, ids, **scales, down_group=per_token_down_group(w2)),
        PROBE_TOLERANCE[expert_kind], logger, against="the reference", replaced="the Triton kernels")


def per_token_down_group(w2: torch.Tensor) -> int:
    """The down GEMM's FP8 input columns per scale on this path: all of I (one scale per token,
    the row-wise recipe torch's scaled grouped GEMM takes)."""
    return w2.shape[2]


def expert_segments(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, row_of_pair, offs): the pairs (flat index t*K + k) sorted by expert, stable
    ([P], pair indices), each pair's row in that order ([P]), and each expert's end row ([E],
    int32, what the grouped GEMMs take). All on the device, no host sync."""
    flat = topk_ids.reshape(-1).long()  # [P]
    order = torch.argsort(flat, stable=True)  # [P]
    row_of_pair = torch.empty_like(order)
    row_of_pair[order] = torch.arange(order.numel(), device=order.device)
    offs = expert_counts(flat, num_experts).cumsum(0).to(torch.int32)  # [E]
    return order, row_of_pair, offs


def grouped_mm(rows: torch.Tensor, weights: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """bf16 rows [P, K] @ weights [E, N, K]^T per expert segment -> [P, N] bf16."""
    return torch._grouped_mm(rows, weights.transpose(1, 2), offs=offs, out_dtype=torch.bfloat16)


def scaled_grouped_mm(rows: torch.Tensor, row_scale: torch.Tensor, weights: torch.Tensor,
                      weight_scale: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """e4m3 rows [P, K] (scale [P]) @ e4m3 weights [E, N, K]^T (scale [E, N]) per expert
    segment -> [P, N] bf16, row-wise scales."""
    return torch._scaled_grouped_mm(rows, weights.transpose(1, 2), row_scale, weight_scale, offs=offs,
                                    out_dtype=torch.bfloat16, use_fast_accum=fp8_fast_accumulation())


def fused_moe_grouped_gemm(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
    fp8_activations: bool = False,
    sum_experts: bool = True,
) -> torch.Tensor | SortedExpertTerms:
    """`fused_moe`'s contract on the grouped GEMMs (module doc), for bf16 hidden states and
    bf16 or per-channel W8A8 experts: [T, H], or with `sum_experts=False` the terms unsummed
    where the GEMM left them (`SortedExpertTerms`)."""
    expert_kind = expert_format(w13, block_shape, fp8_activations)
    if expert_kind is None or hidden.dtype != torch.bfloat16:
        raise ValueError(f"the grouped-GEMM MoE takes bf16 hidden states with bf16 or per-channel W8A8 experts, "
                         f"got hidden {hidden.dtype}, experts {w13.dtype}, blocks {block_shape}, "
                         f"fp8_activations={fp8_activations}")
    num_tokens, top_k = topk_ids.shape
    num_experts, _, hidden_size = w13.shape
    order, row_of_pair, offs = expert_segments(topk_ids, num_experts)
    token_of_row = order // top_k  # [P]: the token each sorted row reads
    if expert_kind == "bf16":
        gate_up = grouped_mm(hidden.index_select(0, token_of_row), w13, offs)  # [P, 2I]
        activated = silu_and_mul(gate_up)  # [P, 2I] -> [P, I] in one pass, rounded as the reference rounds
        down = grouped_mm(activated, w2, offs)  # [P, H]
    else:
        quantized, scale = quantize_activations(hidden, hidden_size)  # [T, H] e4m3, [T, 1]
        rows = quantized.view(torch.uint8).index_select(0, token_of_row).view(FP8_DTYPE)  # [P, H]: gathered as bytes
        gate_up = scaled_grouped_mm(rows, scale[:, 0].index_select(0, token_of_row), w13, w13_scale[..., 0],
                                    offs)  # [P, 2I]
        quantized, scale = silu_and_mul_quantize(gate_up)  # the product quantized per row: [P, I] e4m3, [P, 1]
        down = scaled_grouped_mm(quantized, scale[:, 0].contiguous(), w2, w2_scale[..., 0], offs)  # [P, H]
    terms = SortedExpertTerms(down, row_of_pair.view(num_tokens, top_k), topk_weights)
    return terms if not sum_experts else terms.sum()


@dataclass(frozen=True)
class SortedExpertTerms:
    """A MoE layer's K weighted expert outputs per token, left where the grouped GEMM wrote
    them: term k of token t is `values[rows[t, k]] * weights[t, k]` (values [P, H] in expert
    order, rows and weights [T, K]). The next RMSNorm launch gathers, weighs and sums them in
    its one pass (`kernels.gathered_sum_add_rms_norm`), so the terms are never written out."""

    values: torch.Tensor
    rows: torch.Tensor
    weights: torch.Tensor

    def sum(self) -> torch.Tensor:
        """[T, H]: each product rounded to the values' dtype, the K summed in float32, rounded once."""
        terms = gathered_terms_reference(self.values, self.rows, self.weights)  # [T, K, H]
        return terms.sum(dim=1, dtype=torch.float32).to(self.values.dtype)
