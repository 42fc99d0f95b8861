"""Training test fixtures: one tiny random Qwen3-VL-MoE checkpoint per session."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vlm_catalog.model.tiny_checkpoint import TinySpec, make_tiny_checkpoint
from vlm_catalog.paths import DEFAULT_MODEL_DIR
from vlm_catalog.training.data import TrainingMix
from vlm_catalog.training.trainer import TrainConfig

TINY_SPEC = TinySpec(text_layers=1, hidden_size=32, head_dim=8, num_heads=4, num_kv_heads=2,
                     mrope_section=(2, 1, 1), num_experts=4, moe_intermediate_size=16,
                     intermediate_size=32, vision_depth=1, vision_hidden_size=16,
                     vision_intermediate_size=32, deepstack_visual_indexes=(0,))  # fmt: skip


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random tiny weights with the shipped model's tokenizer (catalogue prompts tokenise compactly)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    spec = TINY_SPEC.with_changes(tokenizer_vocab_size=len(tokenizer))
    return make_tiny_checkpoint(tmp_path_factory.mktemp("training") / "base", spec, seed=3, tokenizer=tokenizer)


@pytest.fixture
def bases_that_do_not_load(tiny_base: Path, tmp_path: Path) -> dict[str, Path]:
    """Checkpoint folders with a config.json that still do not load, by what is wrong with them."""
    other = tmp_path / "another-model"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    damaged = tmp_path / "damaged-weights"
    shutil.copytree(tiny_base, damaged)
    (damaged / "model.safetensors").write_bytes(b"\xff" * 100)  # a header length no file has
    return {"another model's config": other, "damaged weights": damaged}


def tiny_config(base: Path, run_dir: Path, **changes) -> TrainConfig:
    """A run of a few cheap steps: batch 2, a high learning rate so the weights visibly move."""
    values = dict(base=base, run_dir=run_dir, steps=6, batch_size=2, lr=1e-2, warmup=2,
                  save_every=1000, log_every=1, mix=TrainingMix(seed=77, fresh_brand_rate=0.5))
    values.update(changes)
    return TrainConfig(**values)
