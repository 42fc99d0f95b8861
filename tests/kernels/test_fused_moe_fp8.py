"""fused_moe with FP8 (e4m3) expert weights and block scales (kernels/fp8.py).

References: the FP8 reference equals the plain reference on the widened weights
bit for bit (that is its definition); the Triton path is checked against it at
TOLERANCE[activation dtype]; the FP8 weights' own error against the unquantized
experts is measured, with its bound written down.
"""

from __future__ import annotations

import importlib
from functools import partial

import pytest
import torch

import kernels
from kernels.fp8 import (
    DOWN_INPUT_GROUP,
    FP8_DTYPE,
    FP8_MAX,
    dequantize,
    dequantize_activations,
    down_input_group,
    fp8_block_k,
    fp8_k_loop,
    per_channel_block,
    quantize,
    quantize_activations,
    quantize_activations_reference,
    quantize_activations_triton,
    quantize_experts,
)
from kernels.fp8_input import Fp8InputLayout, quantize_fp8_input
from kernels.moe.configs import MoeKernelConfig
from kernels.moe.fused_moe import fused_moe_reference, fused_moe_triton
from tests.kernels.helpers import TOLERANCE, assert_close
from tests.kernels.test_fused_moe import moe_inputs


def widen(quantized: torch.Tensor, scales: torch.Tensor, block, dtype) -> torch.Tensor:
    return torch.stack([dequantize(q, s, block, dtype) for q, s in zip(quantized, scales)])


def fp8_inputs(num_tokens, hidden, intermediate, num_experts, top_k, dtype, device, block):
    states, w13, w2, weights, ids = moe_inputs(num_tokens, hidden, intermediate, num_experts, top_k, dtype, device)
    q13, s13 = quantize_experts(w13, block)
    q2, s2 = quantize_experts(w2, block)
    return (states, q13, q2, weights, ids), dict(w13_scale=s13, w2_scale=s2, block_shape=block), (w13, w2)


# --------------------------------------------------------------------------- the format
def test_quantize_round_trip_and_scale_layout():
    weight = torch.randn(40, 72) * 3
    weight[:16, :32] = 0  # an all-zero block gets scale 1
    quantized, scale = quantize(weight, (16, 32))
    assert quantized.dtype == FP8_DTYPE and scale.shape == (3, 3)  # ceil(40/16), ceil(72/32)
    assert scale[0, 0] == 1 and quantized[:16, :32].float().abs().max() == 0
    # each block's largest element maps to +-448; the rest round to e4m3 (3 mantissa bits)
    assert quantized.float().abs().amax() == FP8_MAX
    restored = dequantize(quantized, scale, (16, 32), torch.float32)
    relative = (restored - weight).abs() / weight.abs().clamp_min(1e-6)
    assert relative[weight.abs() > 0.05].max() <= 2**-4  # half a unit of the 3-bit mantissa
    # rows taken from the middle of the weight use their own scale rows
    torch.testing.assert_close(dequantize(quantized[20:35], scale, (16, 32), torch.float32, first_row=20),
                               restored[20:35], rtol=0, atol=0)


def test_per_channel_block_spans_every_reduction():
    # Qwen3-VL-30B-A3B: hidden 2048, expert intermediate 768; a power of two (the Triton
    # activation quantizer's group) of at least 16
    assert per_channel_block(2048, 768) == (1, 2048)
    assert per_channel_block(96, 64) == (1, 128) and per_channel_block(8) == (1, 16)
    args, scales, _ = fp8_inputs(5, 96, 64, 4, 2, torch.float32, torch.device("cpu"), per_channel_block(96, 64))
    assert scales["w13_scale"].shape == (4, 128, 1) and scales["w2_scale"].shape == (4, 96, 1)  # one per row
    states = args[0]
    _, token_scales = quantize_activations(states, per_channel_block(96, 64)[1])
    torch.testing.assert_close(token_scales[:, 0], states.abs().amax(dim=1) / FP8_MAX)  # one per token


def test_per_channel_fp8_error_against_the_unquantized_experts():
    """Per-channel weights (W8A16), and per-token activations too (W8A8), at the small MoE of
    the block tests, Gaussian weights: 4.5-4.6% and 6.3-6.5% relative L2 over three seeds
    (bounds 6% and 8%); 128 x 128 blocks measure 4.6% and 6.2-6.3% there. Without outliers a
    row's scale costs nothing: an e4m3 value keeps 3 mantissa bits at any magnitude."""
    block = per_channel_block(256, 256)
    args, scales, (w13, w2) = fp8_inputs(64, 256, 256, 8, 2, torch.float32, torch.device("cpu"), block)
    states, _, _, weights, ids = args
    exact = fused_moe_reference(states, w13, w2, weights, ids)
    for fp8_activations, bound in ((False, 6e-2), (True, 8e-2)):
        out = kernels.fused_moe(*args, **scales, fp8_activations=fp8_activations)
        assert 0 < ((out - exact).norm() / exact.norm()).item() < bound


def test_k_step_fits_one_scale_block():
    assert fp8_block_k(128, 128) == 128 and fp8_block_k(128, 64) == 64 and fp8_block_k(64, 128) == 64
    assert fp8_block_k(128, 48) == 16
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8_block_k(64, 40)
    with pytest.raises(ValueError, match="multiple of 16"):  # before: a K step of 8, which no tl.dot takes
        fp8_block_k(64, 8)


def test_a_block_spanning_the_reduction_keeps_the_configured_step_and_scales_after_the_loop():
    assert fp8_k_loop(64, 40, 40) == (64, True)  # one block of 40 over K = 40: any step
    assert fp8_k_loop(128, 2048, 768) == (128, True)  # per_channel_block(2048, 768) on the down GEMM
    assert fp8_k_loop(128, 128, 2048) == (128, False) and fp8_k_loop(128, 48, 96) == (16, False)
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8_k_loop(64, 40, 80)  # two blocks of 40 along K: a step must fit in one


# --------------------------------------------------------------------------- reference
def test_reference_is_the_plain_reference_on_widened_weights():
    block = (16, 16)
    args, scales, _ = fp8_inputs(9, 48, 32, 6, 2, torch.float32, torch.device("cpu"), block)
    states, q13, q2, weights, ids = args
    expected = fused_moe_reference(states, widen(q13, scales["w13_scale"], block, torch.float32),
                                   widen(q2, scales["w2_scale"], block, torch.float32), weights, ids)
    torch.testing.assert_close(kernels.fused_moe(*args, **scales), expected, rtol=0, atol=0)


def test_fp8_weights_error_against_the_unquantized_experts():
    """128 x 128 blocks at a small MoE with Gaussian weights: the output moves by 4.6% in
    relative L2 over three seeds (bound 6%)."""
    args, scales, (w13, w2) = fp8_inputs(64, 256, 256, 8, 2, torch.float32, torch.device("cpu"), (128, 128))
    states, _, _, weights, ids = args
    exact = fused_moe_reference(states, w13, w2, weights, ids)
    error = ((kernels.fused_moe(*args, **scales) - exact).norm() / exact.norm()).item()
    assert 0 < error < 6e-2


# --------------------------------------------------------------------------- triton
CASES = [
    # (T, H, I, E, K, config, block)
    (11, 48, 32, 6, 3, MoeKernelConfig(16, 16, 32, 2, 4, 2), (16, 32)),  # K step 32 = the scale block
    (1, 64, 32, 16, 4, MoeKernelConfig(16, 32, 64, 1, 4, 2), (16, 16)),  # K step cut to the block: 16
    (33, 40, 48, 4, 2, MoeKernelConfig(32, 32, 16, 1, 4, 2), (16, 32)),  # H not a multiple of the block
    (6, 64, 32, 8, 2, None, (32, 32)),  # default config, block_n larger than BLOCK_N
    # per-channel: one block spans each reduction, so both kernels scale after their loops
    (11, 48, 32, 6, 3, MoeKernelConfig(16, 16, 32, 2, 4, 2), per_channel_block(48, 32)),
    (33, 40, 48, 4, 2, MoeKernelConfig(32, 32, 16, 1, 4, 2), per_channel_block(40, 48)),
    # one block spans H (gate/up scales after its loop) but not I (down scales each K step)
    (9, 40, 64, 4, 2, MoeKernelConfig(16, 32, 32, 1, 4, 2), (16, 48)),
    # per-channel blocks exactly H = I wide, of no power of two: no K step has to fit inside them
    (7, 40, 40, 4, 2, MoeKernelConfig(16, 32, 32, 1, 4, 2), (1, 40)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,hidden,intermediate,num_experts,top_k,config,block", CASES)
def test_triton_fp8_experts(
    triton_device, poison_allocations, dtype, num_tokens, hidden, intermediate, num_experts, top_k, config, block
):
    # tolerance: TOLERANCE[dtype] against the FP8 reference (float32 GEMMs on the widened
    # weights, each result rounded to the activation dtype, as the kernel rounds them)
    args, scales, _ = fp8_inputs(num_tokens, hidden, intermediate, num_experts, top_k, dtype, triton_device, block)
    out = fused_moe_triton(*args, config, **scales)
    assert out.dtype == dtype
    assert_close(out, fused_moe_reference(*args, **scales), rel=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,hidden,intermediate,num_experts,top_k,config,block", CASES)
def test_triton_fp8_activations(
    triton_device, poison_allocations, dtype, num_tokens, hidden, intermediate, num_experts, top_k, config, block
):
    # tolerance: TOLERANCE[dtype] against the W8A8 reference (the same quantization of both GEMM
    # inputs, float32 GEMMs on the widened operands, each result rounded to the activation dtype)
    args, scales, _ = fp8_inputs(num_tokens, hidden, intermediate, num_experts, top_k, dtype, triton_device, block)
    out = fused_moe_triton(*args, config, **scales, fp8_activations=True)
    assert_close(out, fused_moe_reference(*args, **scales, fp8_activations=True), rel=TOLERANCE[dtype])


# per-channel experts with I wider than DOWN_INPUT_GROUP: the down GEMM's input in 128-column groups,
# quantized by the gate/up epilogue (BLOCK_N = 128) or by its own launch (BLOCK_N = 64), K steps of 128
# or cut from 256 to the group
PER_CHANNEL_WIDE_I = [
    MoeKernelConfig(16, 128, 128, 1, 4, 2),  # the epilogue quantizes
    MoeKernelConfig(16, 64, 128, 1, 4, 2),  # a separate launch quantizes
    MoeKernelConfig(16, 128, 256, 1, 4, 2),  # the down K step cut to 128
]


@pytest.mark.parametrize("config", PER_CHANNEL_WIDE_I)
def test_per_channel_down_input_in_128_column_groups(triton_device, poison_allocations, config):
    # tolerance: TOLERANCE[bfloat16] against the reference, which quantizes the down input in the
    # same groups (`down_input_group`); I = 320 makes the last group ragged (64 columns)
    block = per_channel_block(64, 320)
    assert down_input_group(block, 320) == DOWN_INPUT_GROUP == 128
    args, scales, _ = fp8_inputs(9, 64, 320, 4, 2, torch.bfloat16, triton_device, block)
    out = fused_moe_triton(*args, config, **scales, fp8_activations=True)
    assert_close(out, fused_moe_reference(*args, **scales, fp8_activations=True), rel=TOLERANCE[torch.bfloat16])
    # the reference with one scale per token differs: the groups are what the kernels use
    per_token = fused_moe_reference(*args, **scales, fp8_activations=True, down_group=320)
    assert not torch.equal(per_token, fused_moe_reference(*args, **scales, fp8_activations=True))


def test_the_gate_up_epilogue_quantizes_as_the_separate_launch_does(triton_device, monkeypatch):
    """The same bits whether the gate/up tile quantizes its product or a launch of the activation
    quantizer does (`quantize_rows` is the arithmetic of both), for per-channel groups of 128 and
    for 32-wide block scales whose last group is ragged (I = 48)."""
    module = importlib.import_module("kernels.moe.fused_moe")
    cases = [(per_channel_block(64, 320), 64, 320, MoeKernelConfig(16, 128, 128, 1, 4, 2)),
             ((16, 32), 40, 48, MoeKernelConfig(32, 32, 16, 1, 4, 2))]
    for block, hidden, intermediate, config in cases:
        assert module.gate_up_writes_whole_groups(config.block_size_n, down_input_group(block, intermediate),
                                                  intermediate)
        args, scales, _ = fp8_inputs(11, hidden, intermediate, 4, 2, torch.float32, triton_device, block)
        fused = fused_moe_triton(*args, config, **scales, fp8_activations=True)
        with monkeypatch.context() as patch:
            patch.setattr(module, "gate_up_writes_whole_groups", lambda *unused: False)
            separate = fused_moe_triton(*args, config, **scales, fp8_activations=True)
        assert torch.equal(fused, separate)


def test_which_gate_up_tiles_quantize_their_product(monkeypatch):
    from kernels.moe.fused_moe import gate_up_writes_whole_groups

    assert gate_up_writes_whole_groups(128, 128, 768)  # the prefill tile, per-channel groups
    assert not gate_up_writes_whole_groups(64, 128, 768)  # half a group per tile (decode tiles)
    assert not gate_up_writes_whole_groups(256, 128, 768)  # two groups per tile
    assert gate_up_writes_whole_groups(64, 64, 48)  # one tile spans I, and one group
    assert not gate_up_writes_whole_groups(32, 64, 48)  # two tiles share the row's one scale
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "moe_gate_up_quantizes")
    assert not gate_up_writes_whole_groups(128, 128, 768)  # switched off: a launch quantizes


def test_down_input_groups(monkeypatch):
    assert down_input_group((128, 128), 768) == 128  # block scales: the weights' block
    assert down_input_group((1, 1024), 768) == DOWN_INPUT_GROUP  # per-channel, I wider than a group
    assert down_input_group((1, 128), 96) == 128  # per-channel, I within one group: per token
    monkeypatch.setenv("VLM_CATALOG_FP8_FAST_ACCUMULATION", "1")
    assert down_input_group((1, 1024), 768) == 1024  # the sums stay in the tensor core: per token


def test_per_channel_down_input_per_token_under_fast_accumulation(triton_device, monkeypatch):
    # tolerance: TOLERANCE[bfloat16] against the reference with one scale per token, the recipe
    # fast accumulation keeps (its sums cannot be scaled per K step)
    monkeypatch.setenv("VLM_CATALOG_FP8_FAST_ACCUMULATION", "1")
    block = per_channel_block(64, 320)
    args, scales, _ = fp8_inputs(9, 64, 320, 4, 2, torch.bfloat16, triton_device, block)
    out = fused_moe_triton(*args, MoeKernelConfig(16, 128, 128, 1, 4, 2), **scales, fp8_activations=True)
    expected = fused_moe_reference(*args, **scales, fp8_activations=True)
    assert torch.equal(expected, fused_moe_reference(*args, **scales, fp8_activations=True, down_group=block[1]))
    assert_close(out, expected, rel=TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("block,chunk", [((16, 32), 16384), (per_channel_block(64, 320), 4)])
def test_hidden_rows_quantized_ahead_give_the_same_bits(triton_device, poison_allocations, monkeypatch, block, chunk):
    """The norm before the experts writes their FP8 input (`hidden_fp8`, in `fused_moe_input_layout`):
    the same answer, bit for bit, as the experts quantizing the 16-bit rows themselves; over
    several chunks too (chunks of 4 tokens: each takes its own rows of the input)."""
    module = importlib.import_module("kernels.moe.fused_moe")
    monkeypatch.setattr(module, "MAX_TOKENS_PER_CHUNK", chunk)
    args, scales, _ = fp8_inputs(11, 64, 320, 4, 2, torch.bfloat16, triton_device, block)
    layout = kernels.fused_moe_input_layout(args[0], *args[1:3], **scales, fp8_activations=True)
    assert layout == Fp8InputLayout(group=block[1], keep_unquantized=True)
    hidden_fp8 = quantize_fp8_input(args[0], layout)
    config = MoeKernelConfig(16, 64, 32, 1, 4, 2)
    expected = fused_moe_triton(*args, config, **scales, fp8_activations=True)
    assert torch.equal(fused_moe_triton(*args, config, **scales, fp8_activations=True, hidden_fp8=hidden_fp8),
                       expected)
    quantizer = importlib.import_module("kernels.fp8")
    calls = []
    real = quantizer.quantize_activations_triton
    monkeypatch.setattr(quantizer, "quantize_activations_triton", lambda *a, **k: calls.append(a[0].shape[1]) or real(*a, **k))
    terms = kernels.fused_moe(*args, config, **scales, fp8_activations=True, sum_experts=False, hidden_fp8=hidden_fp8)
    assert torch.equal(terms.sum(1), expected) if chunk > 11 else torch.equal(terms, expected)
    assert calls and 64 not in calls  # the hidden rows [T, 64] were not quantized again (only the down input, [T*K, 320])


def test_the_experts_ask_for_their_input_quantized_only_on_the_triton_path_with_fp8_activations(
        triton_device, monkeypatch):
    args, scales, _ = fp8_inputs(5, 64, 96, 4, 2, torch.bfloat16, triton_device, (16, 32))
    hidden, w13, w2 = args[:3]
    assert kernels.fused_moe_input_layout(hidden, w13, w2, **scales, fp8_activations=True) is not None
    assert kernels.fused_moe_input_layout(hidden, w13, w2, **scales, fp8_activations=False) is None  # W8A16
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "norm_quantizes")
    assert kernels.fused_moe_input_layout(hidden, w13, w2, **scales, fp8_activations=True) is None
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "fused_moe")  # the reference quantizes its own input
    assert kernels.fused_moe_input_layout(hidden, w13, w2, **scales, fp8_activations=True) is None
    monkeypatch.delenv("VLM_CATALOG_KERNELS_OFF")
    grouped = importlib.import_module("kernels.moe.fused_moe")
    monkeypatch.setattr(grouped, "grouped_gemm_wanted", lambda *unused: True)  # torch's grouped GEMMs
    assert kernels.fused_moe_input_layout(hidden, w13, w2, **scales, fp8_activations=True) is None


def test_hidden_rows_quantized_otherwise_are_refused(triton_device):
    args, scales, _ = fp8_inputs(5, 64, 96, 4, 2, torch.bfloat16, triton_device, (16, 32))
    wrong_group = quantize_fp8_input(args[0], Fp8InputLayout(group=16, keep_unquantized=True))
    with pytest.raises(ValueError, match="hidden_fp8: rows"):
        fused_moe_triton(*args, **scales, fp8_activations=True, hidden_fp8=wrong_group)
    fewer_rows = quantize_fp8_input(args[0][:4], Fp8InputLayout(group=32))
    with pytest.raises(ValueError, match="hidden_fp8: rows"):
        fused_moe_triton(*args, **scales, fp8_activations=True, hidden_fp8=fewer_rows)
    with pytest.raises(ValueError, match="do not take FP8 activations"):
        fused_moe_triton(*args, **scales, hidden_fp8=quantize_fp8_input(args[0], Fp8InputLayout(group=32)))


def test_fp8_activations_quantize_per_token_group():
    values = torch.randn(5, 40) * torch.arange(1, 6)[:, None]  # rows of different ranges
    quantized, scale = quantize_activations(values, 16)
    assert quantized.dtype == FP8_DTYPE and scale.shape == (5, 3)  # ceil(40/16) groups per token
    torch.testing.assert_close(scale[:, 0], values[:, :16].abs().amax(dim=1) / FP8_MAX)
    restored = dequantize_activations(quantized, scale, 16)
    assert ((restored - values).abs() <= values.abs() * 2**-4 + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols,group", [(5, 40, 16), (70, 256, 128), (1, 32, 32), (9, 768, 2048), (3, 40, 64),
                                             (4, 40, 40)])
def test_triton_activation_quantization_matches_the_reference(triton_device, dtype, rows, cols, group):
    # exact under the interpreter (same float32 division and rounding); ragged last group included;
    # groups as wide as the row or wider (per-token scales), of any width, tile the row alone
    values = (torch.randn(rows, cols) * 3).to(dtype).to(triton_device)
    values[0, :group] = 0  # an all-zero group: scale 1
    if group & (group - 1) and group < cols:
        pytest.skip("the kernel takes power-of-two groups, or one group per row")
    got_q, got_scale = quantize_activations_triton(values, group)
    want_q, want_scale = quantize_activations_reference(values, group)
    assert torch.equal(got_scale, want_scale)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


def tiny_groups_quantize_to_zero(device: torch.device) -> None:
    """A float32 group whose largest |x| is below ~3e-43 has max / 448 == 0: its scale is 1, as an
    all-zero group's, so its elements quantize to 0 (with scale 0 they were 0 / 0 = NaN), in the
    Triton quantizer as in the references, activations and weights alike."""
    values = torch.randn(2, 64)
    values[0, :32] = 0
    values[0, 0] = 1e-43  # a subnormal: 1e-43 / 448 rounds to 0
    values = values.to(device)
    for quantized, scale in (quantize_activations_triton(values, 32), quantize_activations_reference(values, 32),
                             quantize(values, (1, 32))):
        assert scale[0, 0].item() == 1.0
        assert torch.equal(quantized[0, :32].float().cpu(), torch.zeros(32))
        assert quantized.float().isfinite().all() and dequantize_activations(quantized, scale, 32).isfinite().all()


def test_tiny_groups_quantize_to_zero(triton_device):
    tiny_groups_quantize_to_zero(triton_device)


@pytest.mark.gpu
def test_gpu_tiny_groups_quantize_to_zero(cuda_device):
    tiny_groups_quantize_to_zero(cuda_device)


def nan_stays_nan_in_every_fp8_writer(device: torch.device) -> None:
    """A NaN in a row reaches the e4m3 output as NaN, in the activation quantizer, the SiLU-and-mul
    one and the norm writing FP8 (kernels/jit/fp8_quant.py, `saturate_fp8`), as the NaN element
    does in the torch references (whose group scale is NaN too, where the GPU's max over the
    group leaves the NaN out). The GPU's plain max/min return the other operand: once such a NaN
    was clamped to -448, a finite value no check downstream would see. Groups without the NaN
    stay finite."""
    from kernels.activation import silu_and_mul_quantize_triton

    values = (torch.randn(3, 64) * 3).to(torch.bfloat16)
    values[1, 5] = float("nan")
    values = values.to(device)
    quantized, _ = quantize_activations_triton(values, 32)
    restored = quantized.float().cpu()
    assert restored[1, 5].isnan()
    assert restored[[0, 2]].isfinite().all() and restored[1, 32:].isfinite().all()
    activated, _ = silu_and_mul_quantize_triton(values)  # [3, 32]: the NaN is in row 1's gate
    assert activated.float()[1, 5].cpu().isnan() and activated.float()[[0, 2]].cpu().isfinite().all()
    normed = kernels.rms_norm(values, torch.ones(64, dtype=torch.bfloat16, device=device), 1e-6,
                              Fp8InputLayout(group=32))
    assert normed.values.float()[1].cpu().isnan().all()  # the row's sum of squares is NaN
    assert normed.values.float()[[0, 2]].cpu().isfinite().all()


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the interpreter's max over the NaN row
def test_a_nan_stays_nan_in_every_fp8_writer(triton_device):
    nan_stays_nan_in_every_fp8_writer(triton_device)


@pytest.mark.gpu
def test_gpu_a_nan_stays_nan_in_every_fp8_writer(cuda_device):
    nan_stays_nan_in_every_fp8_writer(cuda_device)


@pytest.mark.gpu
def test_gpu_activation_quantization_gives_the_reference_bits(cuda_device):
    """On the GPU too: Triton's `/` is an approximate division there (`div.full.f32`), so the
    quantizers divide with `tl.div_rn` (`divide_by_scale`) and give torch's bits, at the engine's
    widths (a 16k-token step's hidden rows, per token and in 128 columns)."""
    values = torch.randn(16384, 2048, device=cuda_device, dtype=torch.bfloat16) * 3
    for group in (2048, 128):
        got_q, got_scale = quantize_activations_triton(values, group)
        want_q, want_scale = quantize_activations_reference(values, group)
        assert torch.equal(got_scale, want_scale), group
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), group


def test_triton_activation_quantization_writes_into_given_outputs_of_any_scale_layout(triton_device):
    """As cuBLAS's block-scaled GEMM wants them (kernels/fp8_linear_cublas.py): the scales with the
    row index fastest, in the first rows of larger, padded outputs that stay untouched beyond."""
    values = (torch.randn(5, 256) * 3).to(torch.bfloat16).to(triton_device)
    quantized = torch.zeros(8, 256, dtype=FP8_DTYPE, device=triton_device)  # [8, K], 5 rows written
    scale = torch.full((2, 8), -1.0, device=triton_device).t()  # [8, K / 128], strides (1, 8)
    quantize_activations_triton(values, 128, quantized[:5], scale[:5])
    want_q, want_scale = quantize_activations_reference(values, 128)
    assert torch.equal(scale[:5], want_scale) and (scale[5:] == -1.0).all()
    assert torch.equal(quantized[:5].view(torch.uint8), want_q.view(torch.uint8))
    assert (quantized[5:].view(torch.uint8) == 0).all()


def test_fp8_activations_error_against_fp8_weights_alone():
    """W8A8 against W8A16 at 128 x 128 blocks: the activations' own rounding moves the output
    by 4.3% relative L2 over three seeds (bound 6%); fp8_activations needs FP8 experts."""
    args, scales, _ = fp8_inputs(64, 256, 256, 8, 2, torch.float32, torch.device("cpu"), (128, 128))
    w8a16 = kernels.fused_moe(*args, **scales)
    error = ((kernels.fused_moe(*args, **scales, fp8_activations=True) - w8a16).norm() / w8a16.norm()).item()
    assert 0 < error < 6e-2
    states, _, _, weights, ids = args
    with pytest.raises(ValueError, match="fp8_activations needs FP8 experts"):
        fused_moe_reference(states, states.new_zeros(8, 512, 256), states.new_zeros(8, 256, 256), weights, ids,
                            fp8_activations=True)


def test_triton_rejects_bad_fp8_arguments(triton_device):
    args, scales, _ = fp8_inputs(4, 32, 16, 4, 2, torch.float32, triton_device, (16, 16))
    states, q13, q2, weights, ids = args
    with pytest.raises(ValueError, match="w13_scale"):
        fused_moe_triton(*args, w13_scale=scales["w13_scale"][:, :1], w2_scale=scales["w2_scale"], block_shape=(16, 16))
    with pytest.raises(ValueError, match="w2_scale or w13_scale|missing"):
        fused_moe_triton(*args, w13_scale=scales["w13_scale"], block_shape=(16, 16))
    with pytest.raises(ValueError, match="w13: dtype"):
        fused_moe_triton(states, q13.float(), q2, weights, ids, **scales)
    with pytest.raises(ValueError, match="multiple of block_n"):
        fused_moe_triton(*args, w13_scale=scales["w13_scale"][:, :1], w2_scale=scales["w2_scale"][:, :1],
                         block_shape=(32, 16))


# W8A8 rounds the bf16 SiLU product to e4m3 (3 mantissa bits) before the down GEMM, so a one-unit
# bf16 difference upstream (any change of summation order) can move an input by a whole e4m3 step
# (up to 2^-3 of it). Measured on an H100 (docs/results/gpu/fp8_moe_reproducibility.txt): the
# reference itself, run on the GPU and on the CPU, differs by 2.1-2.7e-2 of max |expected| at
# T = 256 and 4096; the Triton path is 0.26-1.44e-2 from the GPU reference (the activation
# quantizer matches the torch one code for code). 1e-2 is below that floor (T=4096 measured
# 1.03e-2); 3e-2 is just above the reference's own spread.
W8A8_MODEL_SHAPES_TOLERANCE = 3e-2


@pytest.mark.gpu
@pytest.mark.fast_path("moe_gate_up_quantizes")
@pytest.mark.parametrize("num_tokens", [256, 4096])
def test_gpu_the_gate_up_epilogue_quantizes_as_the_separate_launch_does(cuda_device, monkeypatch, num_tokens):
    # Qwen3-VL-30B-A3B's per-channel W8A8 experts on the prefill tile (128 x 128 x 128): the gate/up
    # epilogue's FP8 product against a launch of the activation quantizer on the 16-bit product
    # (the same arithmetic, `quantize_rows`). Tolerance 1e-2 of max |launch's|: the same sums,
    # rounded the same way, unless the compiler orders the epilogue's float32 steps otherwise and
    # an e4m3 value lands one step apart; the reference comparison is test_gpu_fp8_experts_model_shapes.
    run = per_channel_w8a8_on_the_prefill_tile(num_tokens, cuda_device)
    fused = run()
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "moe_gate_up_quantizes")
    assert_close(fused, run(), rel=1e-2)


def per_channel_w8a8_on_the_prefill_tile(num_tokens: int, device):
    """A call of the fused MoE on Qwen3-VL-30B-A3B's per-channel W8A8 experts (random, `num_tokens`
    tokens) on the H100 table's prefill tile, 128 x 128 x 128 with 8 warps and 4 stages."""
    args, scales, _ = fp8_inputs(num_tokens, 2048, 768, 128, 8, torch.bfloat16, device, per_channel_block(2048, 768))
    return partial(fused_moe_triton, *args, MoeKernelConfig(128, 128, 128, 1, 8, 4), **scales, fp8_activations=True)


@pytest.mark.gpu
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("fp8_activations", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 256, 4096])
def test_gpu_fp8_experts_model_shapes(cuda_device, num_tokens, fp8_activations, per_channel):
    # Qwen3-VL-30B-A3B expert shapes, 128 x 128 scale blocks or per-channel. Tolerance: 1e-2
    # (bfloat16) with FP8 weights; W8A8_MODEL_SHAPES_TOLERANCE with FP8 activations too.
    block = per_channel_block(2048, 768) if per_channel else (128, 128)
    args, scales, _ = fp8_inputs(num_tokens, 2048, 768, 128, 8, torch.bfloat16, cuda_device, block)
    scales["fp8_activations"] = fp8_activations
    rel = W8A8_MODEL_SHAPES_TOLERANCE if fp8_activations else 1e-2
    assert_close(kernels.fused_moe(*args, **scales), fused_moe_reference(*args, **scales), rel=rel)


PERSISTENT_CASES = [  # (weights, hidden, intermediate, config): 128-row tiles, more than the 4 programs a CPU gets
    ("bf16", 64, 48, MoeKernelConfig(128, 32, 16, 2, 8, 3)),
    ("fp8 blocks", 64, 48, MoeKernelConfig(128, 32, 16, 1, 8, 3)),  # 16 x 16 blocks: scaled every K step
    ("w8a8 per-channel", 64, 320, MoeKernelConfig(128, 128, 128, 1, 8, 4)),  # 128-column down groups, epilogue
]


@pytest.mark.parametrize("weights,hidden,intermediate,config", PERSISTENT_CASES, ids=[c[0] for c in PERSISTENT_CASES])
def test_the_persistent_down_gemm_gives_the_bits_of_one_program_per_tile(triton_device, poison_allocations,
                                                                         monkeypatch, weights, hidden, intermediate,
                                                                         config):
    """On the prefill tiles (BLOCK_M 128) the down GEMM runs one program per SM (4 stand in on the
    CPU), each walking several tiles, in one flattened loop: the same bits as one program per
    tile (`moe_down_persistent` off), summed and as unsummed terms, and close to the reference.
    40 tokens to 4 experts (top-2) fill 4 M blocks of 128 rows, with padding blocks past them."""
    # tolerance: exact against one program per tile; TOLERANCE[bfloat16] against the reference
    module = importlib.import_module("kernels.moe.fused_moe")
    assert module.down_runs_persistent(config)
    block = {"fp8 blocks": (16, 16), "w8a8 per-channel": per_channel_block(hidden, intermediate)}.get(weights)
    if block is None:
        from tests.kernels.test_fused_moe import moe_inputs

        args, scales = moe_inputs(40, hidden, intermediate, 4, 2, torch.bfloat16, triton_device), {}
    else:
        args, scales, _ = fp8_inputs(40, hidden, intermediate, 4, 2, torch.bfloat16, triton_device, block)
        scales = {**scales, "fp8_activations": weights.startswith("w8a8")}
    persistent = fused_moe_triton(*args, config, **scales)
    terms = fused_moe_triton(*args, config, **scales, sum_experts=False)  # [T, K, H]
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "moe_down_persistent")
    assert not module.down_runs_persistent(config)
    assert torch.equal(persistent, fused_moe_triton(*args, config, **scales))
    assert torch.equal(terms, fused_moe_triton(*args, config, **scales, sum_experts=False))
    assert_close(persistent, fused_moe_reference(*args, **scales), rel=TOLERANCE[torch.bfloat16])


def test_only_the_prefill_tiles_run_the_persistent_down_gemm():
    module = importlib.import_module("kernels.moe.fused_moe")
    assert module.down_runs_persistent(MoeKernelConfig(128, 128, 128, 1, 8, 4))
    assert not module.down_runs_persistent(MoeKernelConfig(64, 64, 128, 8, 4, 3))  # decode and mid-sized tiles
    assert not module.down_runs_persistent(MoeKernelConfig(16, 64, 128, 1, 4, 4))


@pytest.mark.gpu
@pytest.mark.fast_path("moe_down_persistent")
@pytest.mark.parametrize("num_tokens", [4096, 16384])
def test_gpu_the_persistent_down_gemm_matches_one_program_per_tile(cuda_device, monkeypatch, num_tokens):
    # Qwen3-VL-30B-A3B's per-channel W8A8 experts on the H100 table's prefill tile (128 x 128 x 128,
    # 8 warps, 4 stages), where the down GEMM runs one program per SM walking its tiles in a flattened
    # loop, against one program per tile. Tolerance 1e-2 of max |per tile|: the same sums in the same
    # order, unless the compiler orders an epilogue's float32 steps otherwise in the flattened loop;
    # the reference comparison is test_gpu_fp8_experts_model_shapes.
    run = per_channel_w8a8_on_the_prefill_tile(num_tokens, cuda_device)
    persistent = run()
    assert torch.equal(persistent, run())  # deterministic: each tile is one program's, whichever
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "moe_down_persistent")
    assert_close(persistent, run(), rel=1e-2)
