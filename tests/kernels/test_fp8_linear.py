"""The dense block-FP8 linear (kernels/fp8_linear.py).

References: `fp8_linear_reference` is F.linear in float32 on the widened weight
(and, with fp8_activations, on the input as its quantization sees it), rounded
once; that definition is checked bit for bit. The Triton kernel is checked
against it at TOLERANCE[dtype]; the FP8 weights' and activations' own errors are
measured against exact float32 GEMMs, with their bounds written down.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.fp8 import (
    dequantize,
    dequantize_activations,
    per_channel_block,
    quantize,
    quantize_activations_reference,
)
from kernels.fp8_linear import dense_fp8_config, fp8_linear_reference, fp8_linear_triton
from kernels.moe.configs import MoeKernelConfig
from tests.kernels.helpers import TOLERANCE, assert_close


def linear_inputs(rows, in_features, out_features, block, dtype, device, bias=True):
    x = torch.randn(rows, in_features).to(dtype).to(device)
    weight, scale = quantize(torch.randn(out_features, in_features) / in_features**0.5, block)
    b = (torch.randn(out_features) * 0.1).to(dtype).to(device) if bias else None
    return x, weight.to(device), scale.to(device), b


# --------------------------------------------------------------------------- reference
def test_reference_is_a_float32_gemm_on_the_widened_operands():
    x, weight, scale, bias = linear_inputs(7, 80, 48, (16, 32), torch.bfloat16, "cpu")
    widened = dequantize(weight, scale, (16, 32), torch.float32)
    expected = (x.float() @ widened.t() + bias.float()).to(torch.bfloat16)
    torch.testing.assert_close(fp8_linear_reference(x, weight, scale, (16, 32), bias), expected, rtol=0, atol=0)
    # W8A8: the input as its per-row, per-32-column quantization sees it
    seen = dequantize_activations(*quantize_activations_reference(x, 32), 32)
    expected = (seen @ widened.t() + bias.float()).to(torch.bfloat16)
    got = fp8_linear_reference(x, weight, scale, (16, 32), bias, fp8_activations=True)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # leading dimensions are kept: [2, 3, K] -> [2, 3, N]
    stacked = kernels.fp8_linear(x[:6].view(2, 3, 80), weight, scale, (16, 32), bias)
    torch.testing.assert_close(stacked.view(6, 48), fp8_linear_reference(x[:6], weight, scale, (16, 32), bias))


def test_fp8_error_against_the_exact_gemm():
    """128 x 128 blocks, Gaussian weights and inputs (K = 512), over three seeds: FP8 weights move
    the output by 2.6% relative L2 (bound 4%); with FP8 activations too, by 3.7% (bound 5%)."""
    for seed in range(3):
        torch.manual_seed(seed)
        exact_weight = torch.randn(384, 512) / 512**0.5
        x = torch.randn(64, 512)
        exact = F.linear(x, exact_weight)
        weight, scale = quantize(exact_weight, (128, 128))
        for fp8_activations, bound in ((False, 4e-2), (True, 5e-2)):
            out = kernels.fp8_linear(x, weight, scale, (128, 128), fp8_activations=fp8_activations)
            error = ((out - exact).norm() / exact.norm()).item()
            assert 0 < error < bound, (seed, fp8_activations, error)


def test_bad_arguments_are_named():
    x, weight, scale, bias = linear_inputs(4, 64, 32, (16, 32), torch.float32, "cpu")
    with pytest.raises(ValueError, match="x: the last dimension must be the weight's in_features 64"):
        kernels.fp8_linear(x[:, :48], weight, scale, (16, 32))
    with pytest.raises(ValueError, match="weight: dtype torch.float32"):
        kernels.fp8_linear(x, weight.float(), scale, (16, 32))
    with pytest.raises(ValueError, match="weight_scale: expected shape"):
        kernels.fp8_linear(x, weight, scale, (32, 32))
    with pytest.raises(ValueError, match="bias: expected shape"):
        kernels.fp8_linear(x, weight, scale, (16, 32), bias[:8])
    with pytest.raises(ValueError, match="block must be two positive sizes"):
        kernels.fp8_linear(x, weight, scale, (0, 32))


# --------------------------------------------------------------------------- triton
CASES = [
    # (rows, K, N, block, config)
    (1, 64, 48, (16, 32), None),  # decode-sized: the 16-row tile; BLOCK_K cut to the scale block
    (37, 200, 72, (16, 32), MoeKernelConfig(16, 32, 32, 2, 4, 2)),  # ragged M, K and N; GROUP_M 2
    (70, 128, 96, (32, 64), None),  # the 64-row default tile: BLOCK_N 128 spans three scale rows
    (300, 96, 40, (16, 16), MoeKernelConfig(64, 32, 64, 4, 4, 2)),  # K step cut to 16 by the scale block
    (5, 64, 96, (64, 32), MoeKernelConfig(16, 32, 32, 1, 4, 2)),  # a tile inside one scale row: one scalar scale
    # per-channel: one scale per weight row (and per input row), applied after the K loop
    (37, 200, 72, per_channel_block(200), MoeKernelConfig(16, 32, 32, 2, 4, 2)),  # ragged K: the block is 256
    (70, 128, 96, per_channel_block(128), None),
    # a block exactly K wide, of no power of two: no K step has to fit inside it (the scales come after)
    (9, 40, 48, (1, 40), MoeKernelConfig(16, 32, 32, 1, 4, 2)),
]


@pytest.mark.parametrize("fp8_activations", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,in_features,out_features,block,config", CASES)
def test_triton_matches_the_reference(
    triton_device, poison_allocations, dtype, fp8_activations, rows, in_features, out_features, block, config
):
    # tolerance: TOLERANCE[dtype] against the reference (the same operands, float32 GEMM, one rounding)
    x, weight, scale, bias = linear_inputs(rows, in_features, out_features, block, dtype, triton_device,
                                           bias=rows % 2 == 0)
    out = fp8_linear_triton(x, weight, scale, block, bias, fp8_activations, config)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    expected = fp8_linear_reference(x, weight, scale, block, bias, fp8_activations)
    assert_close(out, expected, rel=TOLERANCE[dtype])


def test_triton_takes_strided_and_stacked_inputs(triton_device):
    x, weight, scale, bias = linear_inputs(12, 64, 32, (16, 32), torch.float32, triton_device)
    strided = torch.randn(12, 128, device=triton_device)[:, ::2]  # last-dim stride 2: copied first
    for inputs in (strided, x.view(3, 4, 64)):
        expected = fp8_linear_reference(inputs, weight, scale, (16, 32), bias)
        assert_close(fp8_linear_triton(inputs, weight, scale, (16, 32), bias), expected, rel=TOLERANCE[torch.float32])
    empty = fp8_linear_triton(x[:0], weight, scale, (16, 32), bias)
    assert empty.shape == (0, 32)


def test_default_tiles_grow_with_the_rows():
    sizes = [dense_fp8_config(rows) for rows in (1, 16, 17, 64, 65, 256, 257, 16384)]
    assert [c.block_size_m for c in sizes] == [16, 16, 32, 32, 64, 64, 128, 128]
    assert all(c.block_size_k == 128 for c in sizes)  # one K step per scale block of Qwen's 128 x 128


@pytest.mark.gpu
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("fp8_activations", [False, True])
@pytest.mark.parametrize("rows", [1, 256, 4096])
@pytest.mark.parametrize("in_features,out_features", [(2048, 5120), (4096, 2048)])
def test_gpu_fp8_linear_model_shapes(cuda_device, rows, in_features, out_features, fp8_activations, per_channel):
    # tolerance: 1e-2 (bfloat16); Qwen3-VL-30B-A3B's fused qkv_proj and o_proj, 128 x 128 blocks
    # or per-channel (whose W8A8 dots accumulate across all of K in the tensor cores' own adder)
    block = per_channel_block(in_features) if per_channel else (128, 128)
    x, weight, scale, _ = linear_inputs(rows, in_features, out_features, block, torch.bfloat16, cuda_device,
                                        bias=False)
    out = kernels.fp8_linear(x, weight, scale, block, fp8_activations=fp8_activations)
    expected = fp8_linear_reference(x, weight, scale, block, fp8_activations=fp8_activations)
    assert_close(out, expected, rel=1e-2)
