"""Random-weight models at given shapes (what the GPU benchmark serves), on CPU at tiny shapes."""

import json

import pytest
import torch

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
