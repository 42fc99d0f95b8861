"""FP8 block-quantized checkpoints (Qwen's -FP8 layout) and FP8 experts.

Reference: the same checkpoint written unquantized with every weight exactly
Q * scale (`write_fp8_checkpoint`'s widened twin). Widening at load must give
its parameters bit for bit; FP8 experts (the CPU path widens each used expert
to float32) must give its float32 logits bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.fp8 import FP8_DTYPE, quantize
from tests.model.helpers import build_checkpoint, write_fp8_checkpoint
from vlm_catalog.model.config import ModelConfig, ModelConfigError
from vlm_catalog.model.fp8 import Fp8BlockQuantization
from vlm_catalog.model.loader import CheckpointError, load_model

BLOCK = (16, 32)  # tiny model: moe_intermediate 32, hidden 64; non-square on purpose


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("fp8")
    original = build_checkpoint(root / "original", tiny_tokenizer, seed=3)
    write_fp8_checkpoint(original, root / "fp8", root / "widened", BLOCK)
    return original, root / "fp8", root / "widened"


def _logits(model, seed: int = 0) -> torch.Tensor:
    from vlm_catalog.engine.paged_attention import (
        PagedAttention,
        PagedAttentionMetadata,
        PrefillBatch,
        allocate_kv_caches,
    )

    text = model.config.text
    ids = torch.randint(0, text.vocab_size, (12,), generator=torch.Generator().manual_seed(seed))
    caches = allocate_kv_caches(text.num_layers, 3, 4, text.num_kv_heads, text.head_dim, model.dtype, model.device)
    metadata = PagedAttentionMetadata(decode=None, prefill=PrefillBatch(
        slot_mapping=torch.arange(12), block_tables=torch.arange(3, dtype=torch.int32)[None],
        cu_seqlens_q=torch.tensor([0, 12], dtype=torch.int32), context_lens=torch.tensor([12], dtype=torch.int32),
        max_query_len=12))
    positions = torch.arange(12)[None].expand(3, -1)
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, PagedAttention(caches, metadata), None))


def test_config_announces_the_block_quantization(checkpoints):
    _, fp8, widened = checkpoints
    assert ModelConfig.from_pretrained(fp8).quantization == Fp8BlockQuantization(*BLOCK)
    assert ModelConfig.from_pretrained(widened).quantization is None


def test_widening_at_load_gives_the_widened_checkpoint_bit_for_bit(checkpoints):
    _, fp8, widened = checkpoints
    expected = load_model(widened).state_dict()
    for mode in ("auto", "none"):  # auto on CPU widens everything
        got = load_model(fp8, quantization=mode).state_dict()
        assert got.keys() == expected.keys()
        for name in expected:
            assert torch.equal(got[name], expected[name]), f"{mode}: {name}"


def test_fp8_experts_hold_the_checkpoints_bytes_and_give_the_same_logits(checkpoints):
    _, fp8, widened = checkpoints
    model = load_model(fp8, quantization="fp8")
    experts = model.language_model.moe_experts()
    assert experts and all(e.gate_up_proj.dtype == FP8_DTYPE and e.fp8_block == BLOCK for e in experts)
    raw = load_file(str(fp8 / "model.safetensors"))
    first = experts[0]
    prefix = "model.language_model.layers.0.mlp.experts.1"
    assert torch.equal(first.gate_up_proj[1, :32].view(torch.uint8), raw[f"{prefix}.gate_proj.weight"].view(torch.uint8))
    assert torch.equal(first.gate_up_proj_scale[1, 2:], raw[f"{prefix}.up_proj.weight_scale_inv"])
    # the CPU path widens each used expert to float32: the same numbers as the widened checkpoint
    torch.testing.assert_close(_logits(model), _logits(load_model(widened)), rtol=0, atol=0)


def test_fp8_quantizes_an_unquantized_checkpoints_experts_at_load(checkpoints):
    original, _, _ = checkpoints
    model = load_model(original, quantization="fp8")
    plain = load_model(original)
    experts, plain_experts = model.language_model.moe_experts()[1], plain.language_model.moe_experts()[1]
    assert experts.fp8_block == (32, 128)  # rows cut to divide the expert intermediate size (32)
    quantized, scale = quantize(plain_experts.down_proj[3], experts.fp8_block)
    assert torch.equal(experts.down_proj[3].view(torch.uint8), quantized.view(torch.uint8))
    assert torch.equal(experts.down_proj_scale[3], scale)
    # FP8 experts move the logits only a little (measured: 1.3% relative L2 over three inputs; bound 10%)
    exact, approximate = _logits(plain), _logits(model)
    assert 0 < ((approximate - exact).norm() / exact.norm()).item() < 0.1


def test_bad_fp8_checkpoints_are_clear_errors(checkpoints, tmp_path):
    import shutil

    _, fp8, _ = checkpoints
    missing = tmp_path / "missing-scale"
    shutil.copytree(fp8, missing)
    tensors = load_file(str(missing / "model.safetensors"))
    del tensors["model.language_model.layers.0.self_attn.q_proj.weight_scale_inv"]
    save_file(tensors, str(missing / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"q_proj.weight is float8 but the checkpoint has no .*q_proj.weight_scale_inv"):
        load_model(missing)

    unannounced = tmp_path / "no-config"
    shutil.copytree(fp8, unannounced)
    config = json.loads((unannounced / "config.json").read_text())
    del config["quantization_config"]
    (unannounced / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="is float8 but config.json has no FP8 quantization_config"):
        load_model(unannounced)

    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (unannounced / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match="quant_method 'awq' is not supported"):
        load_model(unannounced)
    with pytest.raises(CheckpointError, match="quantization must be one of auto, fp8, fp8_w8a8, none"):
        load_model(fp8, quantization="int4")


def test_fp8_activations_stay_close_to_fp8_weights_alone(checkpoints):
    """fp8_w8a8 quantizes the expert GEMMs' inputs per token and column block: the logits move
    by about 1% against FP8 weights alone (measured 1.0-1.1% over three inputs; bound 10%)."""
    _, fp8, _ = checkpoints
    model = load_model(fp8, quantization="fp8_w8a8")
    assert all(experts.fp8_activations for experts in model.language_model.moe_experts())
    weights_only = _logits(load_model(fp8, quantization="fp8"))
    error = ((_logits(model) - weights_only).norm() / weights_only.norm()).item()
    assert 0 < error < 0.1
