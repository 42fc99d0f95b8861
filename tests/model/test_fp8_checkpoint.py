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

from kernels.fp8 import FP8_DTYPE, dequantize, per_channel_block, quantize
from tests.model.helpers import build_checkpoint, write_fp8_checkpoint
from vlm_catalog.model.config import ModelConfig, ModelConfigError
from vlm_catalog.model.fp8 import Fp8BlockQuantization
from vlm_catalog.model.loader import CheckpointError, load_model
from vlm_catalog.model.text import Fp8Linear, dense_input_widths

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
    with pytest.raises(CheckpointError, match="quantization must be one of auto, fp8, fp8_w8a8, fp8_w8a8_channel, none"):
        load_model(fp8, quantization="int4")

    # scales of the wrong shape are named when the weights are requantized per channel too
    cut = tmp_path / "cut-scale"
    shutil.copytree(fp8, cut)
    tensors = load_file(str(cut / "model.safetensors"))
    name = "model.language_model.layers.0.self_attn.o_proj.weight_scale_inv"
    tensors[name] = tensors[name][:1].contiguous()
    save_file(tensors, str(cut / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"o_proj.weight_scale_inv has shape \[1, 2\], expected \[4, 2\]"):
        load_model(cut, quantization="fp8_w8a8_channel")
    # and when they are widened at load (`auto` on CPU, `none`): before, a cut scale was an
    # IndexError, and scales of other blocks than config.json's loaded as a wrong model
    for quantization in ("auto", "none"):
        with pytest.raises(CheckpointError, match=r"o_proj.weight_scale_inv has shape \[1, 2\], expected \[4, 2\]"):
            load_model(cut, quantization=quantization)
    other_blocks = tmp_path / "other-blocks"
    shutil.copytree(fp8, other_blocks)
    config = json.loads((other_blocks / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [BLOCK[0] * 2, BLOCK[1]]
    (other_blocks / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"weight_scale_inv has shape \[\d+, \d+\], expected"):
        load_model(other_blocks, quantization="none")


def test_fp8_activations_stay_close_to_fp8_weights_alone(checkpoints):
    """fp8_w8a8 quantizes every GEMM's input per token and column block (and holds the dense
    projections in FP8, here exactly the checkpoint's): this tiny random model's logits move by
    6.0-8.5% over three inputs against FP8 expert weights alone (bound 15%); 1.0-1.1% of it
    with the expert GEMMs' inputs alone. The shipped model's accuracy is in docs/benchmarks.md."""
    _, fp8, _ = checkpoints
    model = load_model(fp8, quantization="fp8_w8a8")
    assert all(experts.fp8_activations for experts in model.language_model.moe_experts())
    weights_only = load_model(fp8, quantization="fp8")
    for seed in range(3):
        expected = _logits(weights_only, seed)
        error = ((_logits(model, seed) - expected).norm() / expected.norm()).item()
        assert 0 < error < 0.15


def _fp8_linears(model) -> dict[str, Fp8Linear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, Fp8Linear)}


def test_w8a8_holds_an_fp8_checkpoints_dense_projections_as_they_are(tmp_path, tiny_tokenizer):
    original = build_checkpoint(tmp_path / "original", tiny_tokenizer, seed=5, mlp_only_layers=(1,))
    write_fp8_checkpoint(original, tmp_path / "fp8", tmp_path / "widened", BLOCK)
    model = load_model(tmp_path / "fp8", quantization="fp8_w8a8")
    linears = _fp8_linears(model)
    # q/k/v and o in both layers, the dense MLP's gate/up and down in layer 1; the router, the
    # embeddings, lm_head and the vision tower stay as they are
    assert sorted(name.split(".", 3)[-1] for name in linears) == [
        "mlp.down_proj", "mlp.gate_up_proj", "self_attn.o_proj", "self_attn.o_proj",
        "self_attn.qkv_proj", "self_attn.qkv_proj"]
    assert all(linear.weight.dtype == FP8_DTYPE and linear.block == BLOCK for linear in linears.values())
    # each part of a fused projection holds its source tensor's bytes and scale rows
    raw = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    qkv = linears["language_model.layers.0.self_attn.qkv_proj"]
    source = "model.language_model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(qkv.weight[64:96].view(torch.uint8), raw[source].view(torch.uint8))  # q_size 64, kv 32
    assert torch.equal(qkv.weight_scale[4:6], raw[source + "_scale_inv"])  # rows 64..95 in 16-row blocks
    # widened, every FP8 projection is the widened checkpoint's weight bit for bit
    widened = load_model(tmp_path / "widened").state_dict()
    for name, linear in linears.items():
        got = dequantize(linear.weight, linear.weight_scale, BLOCK, torch.float32)
        assert torch.equal(got, widened[f"{name}.weight"]), name


def test_w8a8_quantizes_an_unquantized_checkpoints_dense_projections_at_load(checkpoints):
    original, _, _ = checkpoints
    model, plain = load_model(original, quantization="fp8_w8a8"), load_model(original)
    qkv = model.language_model.layers[1].self_attn.qkv_proj
    assert qkv.block == (32, 128)  # rows cut to divide the k/v part (2 heads x 16)
    quantized, scale = quantize(plain.language_model.layers[1].self_attn.qkv_proj.weight, qkv.block)
    assert torch.equal(qkv.weight.view(torch.uint8), quantized.view(torch.uint8))
    assert torch.equal(qkv.weight_scale, scale)
    # everything in FP8 with FP8 GEMM inputs: the logits move by 8.4-9.8% over three inputs (bound 15%)
    for seed in range(3):
        exact = _logits(plain, seed)
        error = ((_logits(model, seed) - exact).norm() / exact.norm()).item()
        assert 0 < error < 0.15


def test_w8a8_needs_whole_scale_blocks_per_fused_part(tmp_path, tiny_tokenizer):
    original = build_checkpoint(tmp_path / "original", tiny_tokenizer, moe_intermediate_size=64)
    write_fp8_checkpoint(original, tmp_path / "fp8", tmp_path / "widened", (64, 32))  # k/v parts: 32 rows
    with pytest.raises(CheckpointError, match=r"fp8_w8a8.*row counts \[64, 32\].*block size 64"):
        load_model(tmp_path / "fp8", quantization="fp8_w8a8")
    model = load_model(tmp_path / "fp8", quantization="fp8")  # FP8 experts alone need no such thing
    assert not _fp8_linears(model) and model.language_model.moe_experts()[0].fp8_block == (64, 32)


def test_per_channel_w8a8_quantizes_an_unquantized_checkpoint_per_row(checkpoints):
    """fp8_w8a8_channel: one scale per weight row (and per token) for the experts and the dense
    projections, from the unquantized weights. The logits move by a little more than with
    blocks (the test above: 8.4-9.8%): 9.6-10.2% over three inputs (bound 15%)."""
    original, _, _ = checkpoints
    model, plain = load_model(original, quantization="fp8_w8a8_channel"), load_model(original)
    text = model.config.text  # hidden 64, moe_intermediate 32, 4 heads of 16
    experts, plain_experts = model.language_model.moe_experts()[1], plain.language_model.moe_experts()[1]
    assert experts.fp8_block == per_channel_block(64, 32) == (1, 64) and experts.fp8_activations
    assert experts.gate_up_proj_scale.shape == (text.num_experts, 64, 1)  # [E, 2I, 1]: one per row
    quantized, scale = quantize(plain_experts.down_proj[3], (1, 64))
    assert torch.equal(experts.down_proj[3].view(torch.uint8), quantized.view(torch.uint8))
    assert torch.equal(experts.down_proj_scale[3], scale)
    qkv = model.language_model.layers[1].self_attn.qkv_proj
    assert qkv.block == per_channel_block(text.hidden_size, text.num_heads * text.head_dim)
    assert qkv.weight_scale.shape == (qkv.out_features, 1)
    quantized, scale = quantize(plain.language_model.layers[1].self_attn.qkv_proj.weight, qkv.block)
    assert torch.equal(qkv.weight.view(torch.uint8), quantized.view(torch.uint8))
    for seed in range(3):
        exact = _logits(plain, seed)
        error = ((_logits(model, seed) - exact).norm() / exact.norm()).item()
        assert 0 < error < 0.15


def test_per_channel_w8a8_requantizes_an_fp8_checkpoint_per_row(checkpoints):
    """From the checkpoint's 16 x 32 blocks: each weight is widened (exactly the widened
    checkpoint's) and quantized again per row, so the model equals per-channel loading of the
    widened checkpoint bit for bit."""
    _, fp8, widened = checkpoints
    _assert_same_state(load_model(fp8, quantization="fp8_w8a8_channel"),
                       load_model(widened, quantization="fp8_w8a8_channel"))


def _assert_same_state(got_model, expected_model) -> None:
    """Every tensor of both models' state equal in dtype and bits (FP8 ones compared as bytes)."""
    got, want = got_model.state_dict(), expected_model.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        bits = (lambda t: t.view(torch.uint8)) if want[name].dtype == FP8_DTYPE else (lambda t: t)
        assert torch.equal(bits(got[name]), bits(want[name])), name


def test_fp8_weights_requantized_in_place_match_per_channel_loading(checkpoints):
    """`MoEExperts.quantize_` and `Fp8Linear.requantize_` (the GPU benchmark switches a loaded
    model's blocks in place): the same bytes and scales as loading the checkpoint per channel."""
    _, fp8, _ = checkpoints
    model = load_model(fp8, quantization="fp8_w8a8")
    expected = load_model(fp8, quantization="fp8_w8a8_channel")
    decoder, text = model.language_model, model.config.text
    for experts in decoder.moe_experts():
        experts.quantize_(Fp8BlockQuantization(*per_channel_block(text.hidden_size, text.moe_intermediate_size)))
    for module, name in decoder.dense_projections():
        getattr(module, name).requantize_(Fp8BlockQuantization(*per_channel_block(*dense_input_widths(text))))
    _assert_same_state(model, expected)


def test_a_scale_block_the_gpu_kernels_cannot_step_through_is_refused_before_loading(checkpoints):
    """A K block of 24 (not a multiple of 16, narrower than the widths it reduces) loaded, and the
    first forward on the GPU raised in the fused-MoE launch; now the model is not built."""
    from dataclasses import replace

    from vlm_catalog.model.loader import _fp8_dense, _fp8_experts

    _, fp8, _ = checkpoints
    config = ModelConfig.from_pretrained(fp8)
    odd = replace(config, quantization=Fp8BlockQuantization(BLOCK[0], 24))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    with pytest.raises(CheckpointError, match=r"quantization='fp8' needs the FP8 scale block's K size "
                       r"\(weight_block_size\[1\], 24\) to be a multiple of 16 on the GPU, or at least the width "
                       r"its GEMM reduces \(64\)"):
        _fp8_experts(odd, "fp8", cuda)
    with pytest.raises(CheckpointError, match=r"quantization='fp8_w8a8' needs the FP8 scale block's K size"):
        _fp8_dense(odd, "fp8_w8a8", cuda)
    assert _fp8_experts(odd, "auto", cuda) is None  # widened at load, as a block that does not divide the experts
    assert _fp8_experts(odd, "fp8", cpu) == odd.quantization  # the CPU path takes any block
    assert _fp8_experts(config, "fp8", cuda) == config.quantization == Fp8BlockQuantization(*BLOCK)
