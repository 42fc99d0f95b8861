"""Fused MoE expert computation: two grouped GEMMs over expert-sorted rows.

    for every routed pair (t, k), e = topk_ids[t, k]:
        gate, up = linear(hidden[t], w13[e]).chunk(2)      # w13 [E, 2I, H]
        h = silu(gate) * up                                 # [I]
        out[t] += linear(h, w2[e]) * topk_weights[t, k]     # w2 [E, H, I]

Triton path: `moe_align_block_size` groups the pairs by expert in blocks of
BLOCK_SIZE_M; GEMM 1 computes gate and up for a block of pairs with SiLU-and-mul
in its epilogue ([T*K, I] intermediate); GEMM 2 computes down with the routing
weight applied ([T*K, H]); a sum over k gives [T, H]. With `sum_experts=False`
the K terms come back unsummed ([T, K, H]) for the next RMSNorm launch to sum
(`kernels.fused_sum_add_rms_norm`), which saves the sum's launch and a pass
over [T, H].

The reference is transformers' `Qwen3VLMoeTextExperts.forward` loop over the
experts hit (routing weights multiplied in the hidden dtype: transformers casts
them to the router logits' dtype first), with one difference: transformers
accumulates the K expert outputs of a token with `index_add_` in the hidden
dtype, rounding after every add; the reference (like the Triton path) adds them
in float32 and rounds once. In float32 the two are the same; in bfloat16 the
per-add rounding alone moved the result ~1e-2 of max |out| at the 30B-A3B
shapes (K=8), which is what failed the GPU test against the Triton kernel.

FP8 experts (`w13_scale`, `w2_scale`, `block_shape` given): w13 and w2 are
float8 e4m3 with one float32 scale per `block_shape` block (kernels/fp8.py).
The reference widens each expert it uses to float32 (Q * scale), runs its two
GEMMs in float32 and rounds each result to the hidden dtype, as the kernel
does. The Triton path loads FP8 tiles (half the bytes), widens them to the
hidden dtype in registers and applies the scale to each K step's partial
product, before accumulating; the K step is cut to fit inside one scale block.

FP8 activations too (`fp8_activations=True`, "W8A8"): each GEMM's input is
quantized per token and per `block_shape[1]` columns (`quantize_activations`:
dynamic scales, as vLLM and SGLang do for Qwen's -FP8 checkpoints), so both
dot operands are FP8 (twice the tensor-core rate of bf16 on Hopper); each K
step's product is scaled by its rows' activation scales and its columns'
weight scales. The reference quantizes the same way, widens both to float32
and continues as for FP8 weights.

Per-channel FP8 experts are the block layout with one block per weight row
along the whole reduction: `block_shape = (1, K)` with K at least the hidden
and the expert intermediate size (`per_channel_block`); the scales are then
[E, 2I, 1] and [E, H, 1], and FP8 activations get one scale per token. The
kernels see that the scales are constant along K and apply them once after
their loops, which keeps Hopper's wgmma asynchronous (kernels/jit/fused_moe.py).
The down GEMM's input is the exception: one scale per token and 128 columns
(`kernels.fp8.down_input_group`), written by the gate/up kernel's epilogue where
its tile is that wide, which saves the separate quantizing launch and the 16-bit
round trip of the [T*K, I] product.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from kernels import fp8_input
from kernels.attention_common import dot_precision, multiprocessor_count
from kernels.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_block_scales,
    check_dtype,
    check_same_device,
    check_shape,
    check_unit_stride_last_dim,
)
from kernels.dispatch import fp8_fast_accumulation, kernels_off, use_triton, widens_with_ptx
from kernels.fp8 import (
    FP8_DTYPE,
    dequantize,
    down_input_group,
    fp8_block_k,
    fp8_k_loop,
    gemm_input,
    imprecise_accumulation,
    quantize_activations,
    spans_reduction,
)
from kernels.fp8_input import Fp8Input, Fp8InputLayout
from kernels.launch_math import cdiv, triton_dtype
from kernels.moe.align import MoeAlignment, max_padded_pairs
from kernels.moe.configs import MoeKernelConfig, as_moe_config, get_moe_config
from kernels.moe.grouped_gemm import fused_moe_grouped_gemm, grouped_gemm_wanted
from kernels.pdl import launch_options

MAX_TOKENS_PER_CHUNK = 16384  # bounds the [T*K, I] and [T*K, H] intermediates
EPILOGUE_QUANTIZES = "moe_gate_up_quantizes"  # the fast path's name in VLM_CATALOG_KERNELS_OFF
DOWN_PERSISTENT = "moe_down_persistent"  # ... and the persistent down GEMM's (down_runs_persistent)
PERSISTENT_DOWN_MIN_BLOCK_M = 128  # the prefill tiles: one program per SM at 8 warps (down_runs_persistent)


# --------------------------------------------------------------------------- reference
def fused_moe_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeKernelConfig | Mapping[str, int] | None = None,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
    fp8_activations: bool = False,
    alignment: MoeAlignment | None = None,
    down_group: int | None = None,
) -> torch.Tensor:
    """hidden [T, H] -> [T, H]; `config` and `alignment` are ignored (kept for a uniform signature).
    `down_group`: the down GEMM's FP8 input columns per scale, `kernels.fp8.down_input_group` (the
    Triton path's) unless given (the grouped-GEMM path quantizes it per token).

    Transformers' expert loop without its `index_add_` (slow on CPU): each
    expert's tokens are run in transformers' row order (top-k position, then
    token: matmul rounding can depend on row order), each (token, expert)
    pair's weighted output goes to its own row of `pair_out` (rounded to the
    hidden dtype), and each token's rows are added in ascending expert id, the
    order in which transformers accumulates them, in float32, rounded once
    (module doc). Bit-exact with transformers in float32.
    """
    del config, alignment
    _check_fp8_activations(block_shape, fp8_activations)
    num_tokens, top_k = topk_ids.shape
    ids = topk_ids.long()
    weights = topk_weights.to(hidden.dtype)
    _, rank = ids.sort(dim=1)  # rank[t, j]: the top-k position of token t's j-th smallest expert id
    ascending = torch.empty_like(rank).scatter_(1, rank, torch.arange(top_k, device=ids.device).expand_as(rank))
    # pairs numbered k * T + t (k = top-k position), grouped by expert in transformers' order
    ids_by_slot = ids.t().reshape(-1)  # [K*T]
    order = torch.argsort(ids_by_slot, stable=True)
    experts, counts = torch.unique_consecutive(ids_by_slot[order], return_counts=True)
    pair_out = hidden.new_empty((top_k * num_tokens, hidden.shape[1]))  # [K*T, H], row j*T + t
    if block_shape is not None and down_group is None:  # the Triton path's groups, one lookup for every expert
        down_group = down_input_group(block_shape, w2.shape[2])
    for expert, pairs in zip(experts.tolist(), torch.split(order, counts.tolist())):
        tokens, slots = pairs % num_tokens, pairs // num_tokens
        if block_shape is None:
            gate, up = F.linear(hidden[tokens], w13[expert]).chunk(2, dim=-1)  # [n, I] each
            activated = F.silu(gate) * up  # [n, I]
            down = F.linear(activated, w2[expert])  # [n, H]
        else:  # FP8 experts: widen the ones used to float32, round each GEMM's result once
            gate_up_weight = dequantize(w13[expert], w13_scale[expert], block_shape, torch.float32)
            down_weight = dequantize(w2[expert], w2_scale[expert], block_shape, torch.float32)
            inputs = gemm_input(hidden[tokens], block_shape[1], fp8_activations)
            gate, up = F.linear(inputs, gate_up_weight).to(hidden.dtype).chunk(2, dim=-1)
            activated = F.silu(gate) * up  # [n, I]
            down = F.linear(gemm_input(activated, down_group, fp8_activations), down_weight).to(hidden.dtype)
        rows = ascending[tokens, slots] * num_tokens + tokens
        pair_out[rows] = down * weights[tokens, slots, None]  # [n, H]
    per_rank = pair_out.view(top_k, num_tokens, hidden.shape[1])  # [K, T, H], experts in ascending id
    out = per_rank[0].float()  # [T, H] float32 accumulator
    for j in range(1, top_k):
        out += per_rank[j]
    return out.to(hidden.dtype)


# --------------------------------------------------------------------------- triton
def check_fp8_scales(w13, w2, w13_scale, w2_scale, block_shape) -> None:
    """The scales of FP8 experts: one float32 per block of each expert's weight."""
    if w13_scale is None or w2_scale is None:
        raise ValueError("block_shape is given (FP8 experts) but w13_scale or w2_scale is missing")
    for name, weight, scale in (("w13_scale", w13, w13_scale), ("w2_scale", w2, w2_scale)):
        experts, rows, cols = weight.shape
        check_block_scales(name, scale, (rows, cols), block_shape, leading=(experts,))
    if (w13.shape[1] // 2) % block_shape[0]:
        raise ValueError(
            f"w13: the intermediate size {w13.shape[1] // 2} must be a multiple of block_n {block_shape[0]} "
            "(gate and up rows share the stacked scale rows)"
        )


def _check_fp8_activations(block_shape, fp8_activations: bool) -> None:
    if fp8_activations and block_shape is None:
        raise ValueError("fp8_activations needs FP8 experts (block_shape and the weight scales)")


def _check_fused_moe_args(hidden, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None,
                          block_shape=None) -> None:
    check_shape("hidden", hidden, (None, None))
    num_tokens, hidden_size = hidden.shape
    check_shape("w13", w13, (None, None, hidden_size))
    num_experts, two_intermediate, _ = w13.shape
    if two_intermediate % 2:
        raise ValueError(
            f"w13: dim 1 must be 2 * intermediate (gate rows then up rows), got {two_intermediate}"
        )
    check_shape("w2", w2, (num_experts, hidden_size, two_intermediate // 2))
    check_shape("topk_weights", topk_weights, (num_tokens, None))
    check_shape("topk_ids", topk_ids, tuple(topk_weights.shape))
    check_dtype("hidden", hidden, FLOAT_DTYPES)
    weight_dtype = hidden.dtype if block_shape is None else FP8_DTYPE
    check_dtype("w13", w13, (weight_dtype,))
    check_dtype("w2", w2, (weight_dtype,))
    if block_shape is not None:
        check_fp8_scales(w13, w2, w13_scale, w2_scale, block_shape)
    check_dtype("topk_weights", topk_weights, FLOAT_DTYPES)
    check_dtype("topk_ids", topk_ids, INDEX_DTYPES)
    for name, tensor in (("hidden", hidden), ("w13", w13), ("w2", w2)):
        check_unit_stride_last_dim(name, tensor)
    check_same_device(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)


def fused_moe_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeKernelConfig | Mapping[str, int] | None = None,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
    fp8_activations: bool = False,
    sum_experts: bool = True,
    alignment: MoeAlignment | None = None,
    hidden_fp8: Fp8Input | None = None,
) -> torch.Tensor:
    _check_fused_moe_args(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block_shape)
    _check_fp8_activations(block_shape, fp8_activations)
    if hidden_fp8 is not None:
        _check_hidden_fp8(hidden_fp8, hidden, block_shape, fp8_activations)
    if block_shape is not None:
        check_same_device(hidden=hidden, w13_scale=w13_scale, w2_scale=w2_scale)
    scales = None if block_shape is None else (w13_scale, w2_scale, tuple(block_shape))
    num_tokens = hidden.shape[0]
    if alignment is not None and num_tokens > MAX_TOKENS_PER_CHUNK:
        raise ValueError(
            f"alignment: a layout made ahead covers one chunk (at most {MAX_TOKENS_PER_CHUNK} tokens), "
            f"got {num_tokens} tokens"
        )
    if not sum_experts and num_tokens <= MAX_TOKENS_PER_CHUNK:  # one chunk: its terms are the answer
        return _fused_moe_chunk(
            hidden, w13, w2, topk_weights, topk_ids, config, None, scales, fp8_activations, alignment,
            None if hidden_fp8 is None else hidden_fp8.row_range(0, num_tokens),
        )
    out = torch.empty_like(hidden)
    for start in range(0, num_tokens, MAX_TOKENS_PER_CHUNK):
        end = min(start + MAX_TOKENS_PER_CHUNK, num_tokens)
        _fused_moe_chunk(
            hidden[start:end],
            w13,
            w2,
            topk_weights[start:end],
            topk_ids[start:end],
            config,
            out[start:end],
            scales,
            fp8_activations,
            alignment,
            None if hidden_fp8 is None else hidden_fp8.row_range(start, end),
        )
    return out


def _check_hidden_fp8(hidden_fp8: Fp8Input, hidden: torch.Tensor, block_shape: tuple[int, int] | None,
                      fp8_activations: bool) -> None:
    """The hidden rows quantized ahead must be the GEMM input `fused_moe_input_layout` asked for."""
    if not fp8_activations or block_shape is None:
        raise ValueError("hidden_fp8: given, but the experts do not take FP8 activations")
    if hidden_fp8.shape != hidden.shape or hidden_fp8.group != block_shape[1] or hidden_fp8.scale.stride(-1) != 1:
        raise ValueError(f"hidden_fp8: rows {tuple(hidden_fp8.shape)} of group {hidden_fp8.group} (scale strides "
                         f"{hidden_fp8.scale.stride()}), where hidden {tuple(hidden.shape)} takes group "
                         f"{block_shape[1]} with row-major scales")


def fused_moe_input_layout(
    like: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *, w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None, block_shape: tuple[int, int] | None = None, fp8_activations: bool = False,
) -> Fp8InputLayout | None:
    """How `fused_moe` of hidden rows like `like` (their count, dtype and device) takes them
    quantized by the norm before it (`hidden_fp8`, kernels/fp8_input.py): on the Triton path with
    W8A8 experts, one scale per token and the weights' block width, the 16-bit rows kept (the
    router reads them); elsewhere None (the grouped-GEMM path and the reference quantize
    themselves, or take no FP8 input)."""
    if not (fp8_activations and block_shape is not None and fp8_input.wanted()
            and use_triton(like, w13, w2, op="fused_moe")
            and not grouped_gemm_wanted(like, w13, w2, w13_scale, w2_scale, block_shape, fp8_activations)):
        return None
    return Fp8InputLayout(group=block_shape[1], keep_unquantized=True)


def moe_gemm_config(
    num_tokens: int,
    w13: torch.Tensor,
    top_k: int,
    config: MoeKernelConfig | Mapping[str, int] | None = None,
    fp8_activations: bool = False,
    block_shape: tuple[int, int] | None = None,
) -> MoeKernelConfig:
    """The GEMM block sizes `fused_moe` uses for `num_tokens` tokens with these gate/up weights
    (keyed by their dtype: FP8 experts have entries of their own, W8A8 others again; the tuned
    tables of their device first), unless `config` is given. Per-channel W8A8 experts (by
    `block_shape`) whose K loops keep the wgmma chain asynchronous (`asynchronous_k_loops`) have
    entries of their own too; otherwise their loops wait for each K step's wgmma as the
    block-scaled ones do, and take those tiles."""
    if config is None:
        num_experts, two_intermediate, hidden_size = w13.shape
        config = get_moe_config(num_tokens, num_experts, hidden_size, two_intermediate // 2, w13.dtype, top_k,
                                fp8_activations, asynchronous_k_loops(w13, block_shape, fp8_activations), w13.device)
    return as_moe_config(config)


def asynchronous_k_loops(w13: torch.Tensor, block_shape: tuple[int, int] | None, fp8_activations: bool) -> bool:
    """Per-channel FP8 experts whose K loops issue one wgmma after another without waiting: with
    bf16 inputs always; with FP8 ones (W8A8) only where VLM_CATALOG_FP8_FAST_ACCUMULATION leaves
    the sums in the tensor core across K. Otherwise every K step adds its sum into float32
    (`kernels.fp8.imprecise_accumulation`), which waits for that step's wgmma. In the sm_90 SASS
    at T=8192 (Triton 3.9) the per-channel W8A8 loops went from 141 / 110 instructions and no
    full wait (gate/up / down, 128 x 128 x 128 tile) to 281 / 175, 2 / 1 waits and a 24 B
    spill at that tile, and 196 / 131 at the block-scaled one (128 x 64 x 128: 209 / 144 for
    block scales)."""
    if not per_channel_experts(w13, block_shape):
        return False
    return not fp8_activations or fp8_fast_accumulation()


def per_channel_experts(w13: torch.Tensor, block_shape: tuple[int, int] | None) -> bool:
    """FP8 experts whose scale blocks span both GEMMs' reductions (H and I), as per-channel ones
    do: both kernels then scale after their K loops, the loop the per-channel tile entries are
    for (whatever the blocks' row count)."""
    if block_shape is None:
        return False
    _, two_intermediate, hidden_size = w13.shape
    return spans_reduction(block_shape[1], hidden_size) and spans_reduction(block_shape[1], two_intermediate // 2)


def _fused_moe_chunk(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeKernelConfig | Mapping[str, int] | None,
    out: torch.Tensor | None,
    scales: tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None = None,
    fp8_activations: bool = False,
    alignment: MoeAlignment | None = None,
    quantized_hidden: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """The chunk's output summed into `out` [T, H]; with `out` None, its unsummed terms [T, K, H].
    `alignment`: the pairs' layout made ahead (else aligned here). `quantized_hidden`: the chunk's
    FP8 rows [T, H] and scales [T, H/group] written ahead (else quantized here)."""
    from kernels.jit.fused_moe import moe_down_kernel, moe_gate_up_silu_kernel
    from kernels.moe.align import moe_align_block_size

    num_tokens, hidden_size = hidden.shape
    num_experts, two_intermediate, _ = w13.shape
    intermediate = two_intermediate // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    config = moe_gemm_config(num_tokens, w13, top_k, config, fp8_activations, None if scales is None else scales[2])
    # each GEMM's K step, and whether one scale block spans its whole reduction, so that the
    # scales multiply its sums once, after the K loop (jit/fused_moe.py)
    gate_up_block_k = down_block_k = config.block_size_k
    gate_up_scaled_after = down_scaled_after = False
    if scales is None:  # placeholders, never read when FP8_WEIGHTS is False
        w13_scale, w2_scale, (quant_n, quant_k) = hidden, hidden, (1, 1)
        scale_strides = (0, 0, 0, 0)
    else:
        w13_scale, w2_scale, (quant_n, quant_k) = scales
        gate_up_block_k, gate_up_scaled_after = fp8_k_loop(config.block_size_k, quant_k, hidden_size)
        down_block_k, down_scaled_after = fp8_k_loop(config.block_size_k, quant_k, intermediate)
        scale_strides = (w13_scale.stride(0), w13_scale.stride(1), w2_scale.stride(0), w2_scale.stride(1))
    # the down GEMM's FP8 input: one scale per row and `down_group` columns (kernels.fp8.down_input_group)
    down_group = down_input_group((quant_n, quant_k), intermediate) if fp8_activations else quant_k
    act_scales_in_loop = fp8_activations and down_scaled_after and down_group < intermediate
    if act_scales_in_loop:  # each K step inside one group
        down_block_k = fp8_block_k(down_block_k, down_group)
    quantize_in_epilogue = fp8_activations and gate_up_writes_whole_groups(config.block_size_n, down_group,
                                                                          intermediate)

    if alignment is None:
        alignment = MoeAlignment(
            *moe_align_block_size(topk_ids, num_experts, config.block_size_m), config.block_size_m
        )
    else:
        _check_alignment(alignment, num_pairs, num_experts, config.block_size_m)
    sorted_token_ids, expert_ids, num_tokens_post_padded, _ = alignment
    num_m_blocks = expert_ids.shape[0]
    weights = topk_weights.reshape(-1)  # [T*K], flat pair index t * K + k
    if quantize_in_epilogue:  # the gate/up kernel writes the down GEMM's input: [T*K, I] e4m3, [T*K, I/group]
        activated = torch.empty((num_pairs, intermediate), dtype=FP8_DTYPE, device=hidden.device)
        activated_scale = torch.empty((num_pairs, cdiv(intermediate, down_group)), dtype=torch.float32,
                                      device=hidden.device)
    else:
        activated = torch.empty((num_pairs, intermediate), dtype=hidden.dtype, device=hidden.device)
        activated_scale = activated  # a placeholder, never written without QUANTIZE_OUT
    gemm1_input, gemm1_scale = hidden, hidden  # the scale is a placeholder unless FP8_ACTIVATIONS
    if fp8_activations and quantized_hidden is not None:
        gemm1_input, gemm1_scale = quantized_hidden  # [T, H] e4m3, [T, H/group], by the norm before
    elif fp8_activations:
        gemm1_input, gemm1_scale = quantize_activations(hidden, quant_k)  # [T, H] e4m3, [T, H/group]
    pair_out = torch.empty((num_pairs, hidden_size), dtype=hidden.dtype, device=hidden.device)
    meta = dict(
        BLOCK_M=config.block_size_m,
        BLOCK_N=config.block_size_n,
        GROUP_M=config.group_size_m,
        DOT_PRECISION=dot_precision(hidden.dtype),
        FP8_WEIGHTS=scales is not None,
        FP8_ACTIVATIONS=fp8_activations,
        QUANT_N=quant_n,
        QUANT_K=quant_k,
        WIDEN_WITH_PTX=widens_with_ptx(moe_gate_up_silu_kernel),
        **config.launch_options(),
    )

    moe_gate_up_silu_kernel[(num_m_blocks * cdiv(intermediate, config.block_size_n),)](
        # pointers
        gemm1_input,
        gemm1_scale,
        w13,
        w13_scale,
        activated,
        activated_scale,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        # sizes
        num_pairs,
        top_k,
        hidden_size,
        intermediate,
        num_m_blocks,
        # strides
        gemm1_input.stride(0),
        gemm1_scale.stride(0),
        w13.stride(0),
        w13.stride(1),
        scale_strides[0],
        scale_strides[1],
        activated.stride(0),
        activated_scale.stride(0),
        **meta,
        BLOCK_K=gate_up_block_k,
        SCALE_AFTER_LOOP=gate_up_scaled_after,
        IMPRECISE_ACC_K=imprecise_accumulation(gate_up_block_k),
        QUANTIZE_OUT=quantize_in_epilogue,
        OUT_DTYPE=triton_dtype(hidden.dtype),
        **launch_options(gemm1_input),
    )
    gemm2_input, gemm2_scale = activated, activated_scale
    if fp8_activations and not quantize_in_epilogue:
        gemm2_input, gemm2_scale = quantize_activations(activated, down_group)  # [T*K, I] e4m3, [T*K, I/group]
    down_tiles = num_m_blocks * cdiv(hidden_size, config.block_size_n)  # the most: M blocks past the pairs' return
    persistent = down_runs_persistent(config)
    moe_down_kernel[(min(down_tiles, multiprocessor_count(hidden.device)) if persistent else down_tiles,)](
        # pointers
        gemm2_input,
        gemm2_scale,
        w2,
        w2_scale,
        weights,
        pair_out,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        # sizes
        num_pairs,
        intermediate,
        hidden_size,
        num_m_blocks,
        # strides
        gemm2_input.stride(0),
        gemm2_scale.stride(0),
        w2.stride(0),
        w2.stride(1),
        scale_strides[2],
        scale_strides[3],
        weights.stride(0),
        pair_out.stride(0),
        **meta,
        BLOCK_K=down_block_k,
        SCALE_AFTER_LOOP=down_scaled_after,
        IMPRECISE_ACC_K=imprecise_accumulation(down_block_k),
        ACT_GROUP=down_group,
        ACT_SCALES_IN_LOOP=act_scales_in_loop,
        PERSISTENT=persistent,
        **launch_options(gemm2_input),
    )
    terms = pair_out.view(num_tokens, top_k, hidden_size)  # [T*K, H] -> [T, K, H]
    if out is None:
        return terms
    # [T, K, H] -> [T, H]; torch accumulates 16-bit sums in float32 and rounds once, as the reference does
    torch.sum(terms, dim=1, out=out)
    return None


def down_runs_persistent(config: MoeKernelConfig) -> bool:
    """Whether the down GEMM launches one program per SM, each walking its tiles in one flattened
    loop over all their K steps (PERSISTENT, jit/fused_moe.py): on the prefill tiles
    (BLOCK_M >= 128), unless VLM_CATALOG_KERNELS_OFF names `moe_down_persistent`.

    The down GEMM reduces over I = 768: 6 K steps of 128 per tile, and an SM holds one program
    of the prefill tile (214 registers, 128 KiB of shared memory on sm_90). One program per tile
    then waits out its first loads and its epilogue with the tensor cores idle, for a loop about
    as long. In the 2026-11-28 profile it took 0.86 ms per 16k-token call, the gate/up GEMM 1.09
    ms for twice the FLOPs. Flattened, the pipeliner issues the next tile's loads during the
    current tile's last steps and its epilogue. The gate/up GEMM (16 K steps a tile) is left as
    it is: flattened, its 255 registers spilled."""
    return config.block_size_m >= PERSISTENT_DOWN_MIN_BLOCK_M and DOWN_PERSISTENT not in kernels_off()


def gate_up_writes_whole_groups(block_n: int, down_group: int, intermediate: int) -> bool:
    """Whether every gate/up tile of `block_n` columns holds whole groups of the down GEMM's FP8
    input, exactly one: then its epilogue quantizes the product (QUANTIZE_OUT), unless
    VLM_CATALOG_KERNELS_OFF names `EPILOGUE_QUANTIZES`. True where the tile is one group wide (the
    prefill tiles, 128 x 128, with per-channel experts' 128-column groups), or where one tile
    and one group both span I."""
    if EPILOGUE_QUANTIZES in kernels_off():
        return False
    return block_n == down_group or (block_n >= intermediate and down_group >= intermediate)


def _check_alignment(alignment: MoeAlignment, num_pairs: int, num_experts: int, block_size_m: int) -> None:
    if alignment.block_size != block_size_m:
        raise ValueError(
            f"alignment: made for GEMM blocks of {alignment.block_size} rows, but the config's "
            f"block_size_m is {block_size_m}"
        )
    expected = max_padded_pairs(num_pairs, num_experts, block_size_m)
    if alignment.sorted_token_ids.numel() != expected:
        raise ValueError(
            f"alignment: sorted_token_ids has {alignment.sorted_token_ids.numel()} entries, "
            f"{num_pairs} pairs over {num_experts} experts take {expected}"
        )


# --------------------------------------------------------------------------- dispatch
def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeKernelConfig | Mapping[str, int] | None = None,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
    fp8_activations: bool = False,
    sum_experts: bool = True,
    alignment: MoeAlignment | None = None,
    hidden_fp8: Fp8Input | None = None,
) -> torch.Tensor:
    """hidden [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I],
    topk_weights / topk_ids [T, K] -> [T, H]. `config`: GEMM block sizes
    (default: `kernels.moe.configs.get_moe_config`). FP8 experts: w13/w2 in
    float8 e4m3 with `w13_scale` [E, 2I/bn, H/bk] and `w2_scale` [E, H/bn, I/bk]
    (float32), `block_shape` = (bn, bk); `fp8_activations`: the GEMM inputs in FP8 too.
    `sum_experts=False`: the Triton path may return the K weighted expert outputs
    [T, K, H] unsummed (up to MAX_TOKENS_PER_CHUNK tokens), and the grouped-GEMM path a
    `SortedExpertTerms`; the caller takes any of the three (`RMSNorm.add_and_norm`).
    `alignment`: the pairs' layout made ahead (`route_topk_and_align`), for the same topk_ids and
    the config's block_size_m; the reference path ignores it. `hidden_fp8`: hidden quantized ahead in
    `fused_moe_input_layout` (the same bits the Triton path's own quantizer makes, which it then
    skips; the other paths ignore it). With VLM_CATALOG_MOE_GEMM=grouped_mm,
    prefill-sized calls on Hopper take torch's grouped GEMMs instead (kernels/moe/grouped_gemm.py)."""
    scales = dict(
        w13_scale=w13_scale, w2_scale=w2_scale, block_shape=block_shape, fp8_activations=fp8_activations,
        alignment=alignment,
    )
    if use_triton(hidden, w13, w2, topk_weights, topk_ids, op="fused_moe"):
        if grouped_gemm_wanted(hidden, w13, w2, w13_scale, w2_scale, block_shape, fp8_activations):
            return fused_moe_grouped_gemm(hidden, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale,
                                          w2_scale=w2_scale, block_shape=block_shape,
                                          fp8_activations=fp8_activations, sum_experts=sum_experts)
        return fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids, config, **scales, sum_experts=sum_experts,
                                hidden_fp8=hidden_fp8)
    return fused_moe_reference(hidden, w13, w2, topk_weights, topk_ids, config, **scales)
