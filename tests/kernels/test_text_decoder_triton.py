"""The text decoder on the Triton kernels (q/k-norm MRoPE, RMSNorm, routing, fused MoE with its
expert terms summed inside the next norm) gives the reference path's output, deepstack included."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from kernels import fp8_linear_cublas as cublas
from kernels.fp8 import per_channel_block
from tests.kernels.helpers import FLOAT32_TOLERANCE, TOLERANCE, assert_close
from tests.kernels.test_fp8_linear_cublas import documented_scaled_mm
from vlm_catalog.model.attention import ContiguousKVCache
from vlm_catalog.model.config import TextConfig
from vlm_catalog.model.fp8 import Fp8BlockQuantization
from vlm_catalog.model.text import MultimodalEmbeddings, TextDecoder, dense_input_widths


def tiny_decoder(dtype: torch.dtype, device) -> TextDecoder:
    config = TextConfig(
        vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=48, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=3,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=(1,), rms_norm_eps=1e-6,
        rope_theta=10000.0, mrope_section=(2, 3, 3), attention_bias=False, hidden_act="silu",
    )
    decoder = TextDecoder(config)
    with torch.no_grad():
        for parameter in decoder.parameters():
            parameter.normal_(0, 0.3)
    decoder = decoder.to(dtype).to(device)
    decoder.reset_rotary_buffers()  # float32 rotary tables, as the loader leaves them
    return decoder


@pytest.mark.parametrize("lengths,image_rows", [
    ([7, 5], [2, 3, 9]),  # image tokens in both sequences
    ([2, 1], [0, 1, 2]),  # a batch the size of a decode step's: the post-attention norm and router in one launch
], ids=["12 tokens", "3 tokens"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_on_triton_matches_the_reference_path(triton_device, monkeypatch, dtype, lengths, image_rows):
    # tolerance: FLOAT32_TOLERANCE in float32; in bfloat16 TOLERANCE (1e-2) of max |expected|:
    # the two paths round a few intermediates differently (1 unit each) over 3 layers
    decoder = tiny_decoder(dtype, triton_device)
    input_ids = torch.randint(0, 64, (sum(lengths),), device=triton_device)
    positions = torch.arange(sum(lengths), device=triton_device).expand(3, -1).contiguous()  # [3, T]
    rows = torch.tensor(image_rows, device=triton_device)
    multimodal = MultimodalEmbeddings(
        rows=rows,
        embeddings=torch.randn(3, 32, device=triton_device).to(dtype),
        deepstack=[torch.randn(3, 32, device=triton_device).to(dtype)],  # after layer 0, a MoE layer
    )

    def forward() -> torch.Tensor:
        attention = ContiguousKVCache(3)
        attention.plan(["a", "b"], lengths)
        with torch.inference_mode():
            return decoder(input_ids, positions, attention, multimodal)

    on_triton = forward()
    monkeypatch.setenv("VLM_CATALOG_KERNELS", "reference")
    on_reference = forward()
    assert on_triton.shape == (sum(lengths), 32)
    tolerance = FLOAT32_TOLERANCE if dtype == torch.float32 else TOLERANCE[dtype]
    assert_close(on_triton, on_reference, rel=tolerance)


def test_decoder_with_the_grouped_gemm_moe_matches_the_reference_path(triton_device, monkeypatch):
    """The MoE layers on torch's grouped GEMMs (forced here: on a GPU only prefill-sized calls on
    Hopper take them), their terms gathered by the next norm's Triton kernel, deepstack's sum
    included; tolerance TOLERANCE[bfloat16], as above."""
    import sys

    fused_moe_module = sys.modules["kernels.moe.fused_moe"]
    taken = []

    def wanted(hidden, *args):
        taken.append(hidden.shape[0])
        return True

    monkeypatch.setattr(fused_moe_module, "grouped_gemm_wanted", wanted)
    decoder = tiny_decoder(torch.bfloat16, triton_device)
    input_ids = torch.randint(0, 64, (9,), device=triton_device)
    positions = torch.arange(9, device=triton_device).expand(3, -1).contiguous()  # [3, T]
    multimodal = MultimodalEmbeddings(rows=torch.tensor([1, 4], device=triton_device),
                                      embeddings=torch.randn(2, 32, device=triton_device).to(torch.bfloat16),
                                      deepstack=[torch.randn(2, 32, device=triton_device).to(torch.bfloat16)])

    def forward() -> torch.Tensor:
        attention = ContiguousKVCache(3)
        attention.plan(["a"], [9])
        with torch.inference_mode():
            return decoder(input_ids, positions, attention, multimodal)

    on_grouped = forward()
    assert taken == [9, 9]  # layers 0 and 2 are MoE layers (1 is dense)
    monkeypatch.setenv("VLM_CATALOG_KERNELS", "reference")
    assert_close(on_grouped, forward(), rel=TOLERANCE[torch.bfloat16])


def w8a8_tiny_decoder(device) -> TextDecoder:
    """`tiny_decoder` in bfloat16 with per-channel W8A8 experts and dense projections (the record
    engine's `fp8_w8a8_channel`)."""
    decoder = tiny_decoder(torch.bfloat16, device)
    text = decoder.config
    for experts in decoder.moe_experts():
        experts.quantize_(Fp8BlockQuantization(*per_channel_block(text.hidden_size, text.moe_intermediate_size)))
        experts.fp8_activations = True
    decoder.use_fp8_linears(Fp8BlockQuantization(*per_channel_block(*dense_input_widths(text))),
                            quantize_present=True)
    return decoder


@pytest.mark.parametrize("lengths,quantizing_norms,hidden_quantizations", [
    ([7, 5], 5, 1),  # 3 q/k/v inputs and 2 MoE inputs by their norms; the dense MLP's input by its GEMM
    ([2, 1], 3, 3),  # a decode-sized batch: the MoE layers' norms run with the router in one launch
], ids=["12 tokens", "3 tokens"])
def test_w8a8_norms_write_the_gemms_fp8_inputs_with_the_same_answer(
        triton_device, monkeypatch, lengths, quantizing_norms, hidden_quantizations):
    """Where q/k/v runs on cuBLAS (here the documented stand-in for `F.scaled_mm`) and the experts
    on Triton with FP8 activations, the norms before them write their FP8 inputs: the decoder's
    output is the same, bit for bit, as with `norm_quantizes` off, where the GEMMs quantize the
    norms' 16-bit rows themselves (exact: one arithmetic, `quantize_rows`)."""
    norms, quantizer = importlib.import_module("kernels.rms_norm"), importlib.import_module("kernels.fp8")
    monkeypatch.setattr(cublas, "device_supported", lambda device: True)  # a CPU passing for a Hopper GPU
    monkeypatch.setattr(F, "scaled_mm", documented_scaled_mm)
    monkeypatch.setattr(cublas, "_checked", {})
    decoder = w8a8_tiny_decoder(triton_device)
    tokens = sum(lengths)
    input_ids = torch.randint(0, 64, (tokens,), device=triton_device)
    positions = torch.arange(tokens, device=triton_device).expand(3, -1).contiguous()  # [3, T]
    multimodal = MultimodalEmbeddings(rows=torch.tensor([0, 2], device=triton_device),
                                      embeddings=torch.randn(2, 32, device=triton_device).to(torch.bfloat16),
                                      deepstack=[torch.randn(2, 32, device=triton_device).to(torch.bfloat16)])
    layouts, quantized_shapes = [], []  # the norms' FP8 layouts; the quantizer's inputs
    real_empty_fp8_input, real_quantize = norms.empty_fp8_input, quantizer.quantize_activations_triton
    monkeypatch.setattr(norms, "empty_fp8_input", lambda *a: layouts.append(a[2]) or real_empty_fp8_input(*a))
    monkeypatch.setattr(quantizer, "quantize_activations_triton",
                        lambda x, *a, **k: quantized_shapes.append(tuple(x.shape)) or real_quantize(x, *a, **k))

    def forward() -> torch.Tensor:
        layouts.clear()
        quantized_shapes.clear()
        attention = ContiguousKVCache(3)
        attention.plan(["a", "b"], lengths)
        with torch.inference_mode():
            return decoder(input_ids, positions, attention, multimodal)

    fused = forward()
    assert len(layouts) == quantizing_norms and quantized_shapes.count((tokens, 32)) == hidden_quantizations
    assert sum(layout.keep_unquantized for layout in layouts) == quantizing_norms - 3  # the MoE's: the router's
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "norm_quantizes")
    separate = forward()
    assert not layouts and quantized_shapes.count((tokens, 32)) == 6  # 3 q/k/v, 2 MoE and the dense MLP's gate/up
    assert torch.equal(fused, separate)
