"""Random-weight models at given shapes (what the GPU benchmark serves), on CPU at tiny shapes."""

import json

import pytest
import torch

from tests.bench.test_gpu_session import load_script
from vlm_catalog.bench.random_model import (
    benchmark_checkpoint_dir,
    random_model,
    random_transformers_model,
)
from vlm_catalog.engine.config import EngineConfig, EngineConfigError
from vlm_catalog.engine.llm_engine import LLMEngine
from vlm_catalog.engine.sampling_params import SamplingParams
from vlm_catalog.paths import DEFAULT_MODEL_DIR

SHAPES = {
    "text_config": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                    "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                    "intermediate_size": 64, "vocab_size": 5000,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2],
                                        "mrope_interleaved": True}},
    "vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
                      "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
    "tie_word_embeddings": False,
}


def test_weightless_checkpoint_random_model_and_engine_injection(tmp_path):
    checkpoint = benchmark_checkpoint_dir(tmp_path / "ckpt", SHAPES)
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["text_config"]["vocab_size"] == 5000 and not (checkpoint / "model.safetensors").exists()
    model = random_model(checkpoint, "cpu", torch.float32, seed=3)
    weights = model.language_model.layers[0].mlp.experts.gate_up_proj
    assert 0.015 < float(weights.std()) < 0.025  # Normal(0, 0.02)
    assert torch.equal(model.language_model.norm.weight, torch.ones(32))
    # the embeddings at std 1, and the residual streams' output projections at 0.02 / sqrt(2 * layers)
    assert 0.95 < float(model.language_model.embed_tokens.weight.std()) < 1.05
    assert 0.8 < float(model.visual.pos_embed.weight.std()) < 1.2
    layer = model.language_model.layers[1]
    assert 0.008 < float(layer.self_attn.o_proj.weight.std()) < 0.012  # 0.02 / sqrt(2 * 2 layers) = 0.01
    assert 0.008 < float(layer.mlp.experts.down_proj.std()) < 0.012
    assert 0.012 < float(model.visual.blocks[0].mlp.linear_fc2.weight.std()) < 0.016  # 1 block: 0.02 / sqrt(2)
    assert 0.015 < float(layer.self_attn.qkv_proj.weight.std()) < 0.025  # the rest at 0.02
    again = random_model(checkpoint, "cpu", torch.float32, seed=3)
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)  # seeded

    engine = LLMEngine(EngineConfig(model=checkpoint), prebuilt_model=model)
    engine.add_request([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=5, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finished and len(final.token_ids) == 5  # ids past the 4096-entry tokenizer are skipped in text

    with pytest.raises(EngineConfigError, match="does not match"):
        LLMEngine(EngineConfig(model=DEFAULT_MODEL_DIR), prebuilt_model=model)


def test_random_transformers_model_runs(tmp_path):
    checkpoint = benchmark_checkpoint_dir(tmp_path / "ckpt", SHAPES)
    model = random_transformers_model(checkpoint, "cpu", torch.float32)
    logits = model(input_ids=torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, 5000) and torch.isfinite(logits).all()


def load_random_routing():
    return load_script("random_routing")


def routing_of_benchmark_records(tmp_path, spread_routing: bool = True) -> dict:
    """The random model's routing over 4 benchmark records (their prefill, then 2 decode steps) at
    Qwen3-VL-30B-A3B's routing shapes (48 layers, 128 experts, top-8) at width 256: how spread the
    routing is depends on the depth, the experts and what each layer adds to the residual stream
    (scripts/random_routing.py keeps the latter at the 30B's when it narrows the experts)."""
    script = load_random_routing()
    return script.routing_of_benchmark_records(tmp_path, script.routing_shapes(256, 48, 96), spread_routing=spread_routing)


def test_random_model_routes_tokens_about_as_spread_as_uniform_routing(tmp_path):
    summary = routing_of_benchmark_records(tmp_path)
    large, small = summary["large_calls"], summary["small_calls"]
    assert large["calls"] == 2 and small["calls"] == 2  # the prompts (two calls on CPU), then 2 decode steps
    # uniform routing gives the busiest 8 of 128 experts about 6% of the slots (measured: 13%)
    assert large["top_k_share"] < 0.25 and large["top_k_share_worst_layer"] < 0.4
    assert large["experts_unused"] == 0
    # 3-4 decode tokens touch about 21-28 experts per layer under uniform routing (measured: within 10%)
    assert small["distinct_over_uniform"] > 0.85


def test_routing_recorder_sees_the_collapse_of_the_old_initialisation(tmp_path):
    """The random model as it was until 2026-11-28 (every weight at std 0.02): from the middle
    layers on, every token went to about the same experts."""
    summary = routing_of_benchmark_records(tmp_path, spread_routing=False)
    assert summary["large_calls"]["top_k_share"] > 0.5 and summary["large_calls"]["top_k_share_worst_layer"] > 0.8
    assert summary["small_calls"]["distinct_over_uniform"] < 0.5


def test_routing_recorder_counts_loads_and_distinct_experts():
    from vlm_catalog.bench.routing_stats import RoutingRecorder
    from vlm_catalog.model.config import ModelConfig
    from vlm_catalog.model.text import SparseMoE

    text = ModelConfig.from_dict({**load_random_routing().routing_shapes(256, 2, 96), "model_type": "qwen3_vl_moe"}).text
    model = torch.nn.ModuleList([SparseMoE(text), SparseMoE(text)])
    for parameter in model.parameters():
        parameter.data.zero_()  # the experts' output is not looked at; defined values all the same
    for router in model:  # logits = the first 128 hidden features: the tokens choose their experts
        router.gate.weight.data = torch.eye(128, 256)
    hot = torch.zeros(2048, 256)
    hot[:, :8] = 1.0  # every token of the large call chooses experts 0-7
    pair = torch.zeros(2, 256)
    pair[0, :8], pair[1, 8:16] = 1.0, 1.0  # the small call's two tokens: experts 0-7 and 8-15
    hot_routing = model[0].route(hot)
    with RoutingRecorder(model) as recorder:
        for router in model:
            router(hot, routing=hot_routing)  # the routing the decoder passes
            router(pair)  # or the layer's own
    model[0](pair)  # after the block: not counted
    summary = recorder.summary()
    assert summary["uniform_top_k_share"] == 8 / 128
    assert summary["large_calls"] == {"calls": 1, "top_k_share": 1.0, "top_k_share_worst_layer": 1.0,
                                      "max_over_mean_load": 16.0, "experts_unused": 2 * 120}
    uniform_pair = 128 * (1 - (120 / 128) ** 2)  # 15.5 experts
    assert summary["small_calls"]["calls"] == 1 and summary["small_calls"]["distinct_experts"] == 16
    assert summary["small_calls"]["distinct_over_uniform"] == pytest.approx(16 / uniform_pair)


def test_routing_recorder_counts_rows_the_norm_quantized(monkeypatch):
    """On the GPU's W8A8 path the norm hands each MoE layer its rows quantized, with their 16-bit
    rows kept (`Fp8Input`, kernels/fp8_input.py), and the routing made in its launch. The recorder
    counts those calls as it counts 16-bit rows (it once failed on them: an Fp8Input has no
    `is_cuda`, so the record of 2026-11-29's plan would have had no routing line)."""
    from kernels.fp8_input import Fp8Input, Fp8InputLayout, quantize_fp8_input
    from vlm_catalog.bench.routing_stats import RoutingRecorder
    from vlm_catalog.model.config import ModelConfig
    from vlm_catalog.model.text import SparseMoE

    text = ModelConfig.from_dict({**load_random_routing().routing_shapes(256, 1, 96), "model_type": "qwen3_vl_moe"}).text
    layer = SparseMoE(text)
    layer.gate.weight.data = torch.eye(128, 256)  # logits = the first 128 hidden features
    hot = torch.zeros(2048, 256)
    hot[:, 8:16] = 1.0  # every token chooses experts 8-15
    quantized = quantize_fp8_input(hot, Fp8InputLayout(group=256, keep_unquantized=True))
    assert isinstance(quantized, Fp8Input)
    monkeypatch.setattr(layer, "forward", lambda hidden, sum_experts=True, routing=None: None)  # the hook is tested
    with RoutingRecorder(torch.nn.ModuleList([layer])) as recorder:
        layer(quantized, routing=layer.route(hot))  # as DecoderLayer.mlp_terms calls it
        layer(quantized)  # or routing itself, from the kept rows
    summary = recorder.summary()
    assert summary["large_calls"]["calls"] == 2 and summary["large_calls"]["top_k_share"] == 1.0
    assert summary["large_calls"]["experts_unused"] == 120


def test_routing_recorder_needs_moe_layers():
    from vlm_catalog.bench.routing_stats import RoutingRecorder

    with pytest.raises(ValueError, match="no MoE layers"):
        RoutingRecorder(torch.nn.Linear(2, 2))


def test_random_routing_script_prints_the_summary_and_checks_its_options(capsys):
    script = load_random_routing()
    assert script.main(["--layers", "2", "--width", "64", "--expert-width", "16", "--records", "1"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["layers"] == 2 and summary["experts"] == 128 and summary["large_calls"]["calls"] >= 1
    with pytest.raises(SystemExit):
        script.main(["--records", "0"])
    assert "--records must be >= 1, got 0" in capsys.readouterr().err
