"""Models with random weights at real shapes, built on the device (no checkpoint, no download).

`benchmark_checkpoint_dir` writes what the engine reads besides weights
(config.json with the given shapes, the default model's tokenizer and chat
template, Qwen3-VL's preprocessor settings); `random_model` builds our model
on the device with random weights (`random_vision_tower`: the vision tower
alone); `random_transformers_model` does the same for transformers' reference
implementation.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from vlm_catalog.model.config import ModelConfig
from vlm_catalog.model.qwen3_vl_moe import Qwen3VLMoeModel
from vlm_catalog.paths import DEFAULT_MODEL_DIR

# Qwen3-VL-30B-A3B (see ../shared/docs/TASK.md and transformers' Qwen3VLMoeConfig)
QWEN3_VL_30B_A3B: dict[str, Any] = {
    "text_config": {
        "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "intermediate_size": 6144, "vocab_size": 151936, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                            "mrope_interleaved": True},
    },
    "vision_config": {
        "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "patch_size": 16,
        "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 2048,
        "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
    },
    "tie_word_embeddings": False,
}
QWEN3_VL_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def benchmark_checkpoint_dir(directory: Path, shapes: dict[str, Any], tokenizer_dir: Path = DEFAULT_MODEL_DIR) -> Path:
    """A weightless checkpoint directory: `shapes`, plus the tokenizer and its special token ids."""
    from transformers import AutoTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    special = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
    )}
    config = {"model_type": "qwen3_vl_moe", "architectures": ["Qwen3VLMoeForConditionalGeneration"], **shapes, **special}
    config["text_config"] = {**shapes["text_config"], "model_type": "qwen3_vl_moe_text"}
    config["vision_config"] = {**shapes["vision_config"], "model_type": "qwen3_vl_moe_vision"}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "preprocessor_config.json").write_text(json.dumps(QWEN3_VL_PREPROCESSOR, indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory


# How the weights are drawn so that the routers spread tokens as a trained model's do (its
# training balanced them). With every weight at std 0.02, each layer added more to the residual
# stream than a token's own embedding held, the stream's direction converged across tokens with
# depth, and the routers sent nearly every token to the same few experts: the MoE then cost a
# fraction of a trained model's. Two changes keep each token's identity in the router's input at
# every layer, in the text model and in the vision tower (whose patches become image tokens):
# - the embeddings, the text's token embeddings and the vision tower's position embeddings (a
#   flat background's patches differ by little else), at std 1 (EMBEDDING_STD);
# - the projections that write into a residual stream (the text's o_proj and the MLPs' and
#   experts' down_proj; the vision blocks' attn.proj and mlp.linear_fc2) at std
#   0.02 / sqrt(2 * layers), GPT-2's scaled initialisation.
# `spread_routing=False` draws every weight at std 0.02, as until 2026-11-28. Measured with
# scripts/random_routing.py (docs/benchmarks.md); tests/bench/test_random_model.py holds it at the
# 30B's routing shapes.
EMBEDDING_STD = 1.0
EMBEDDINGS = ("embed_tokens.weight", "pos_embed.weight")
# (a layer's name with its index as the group, the names of its residual-stream output projections)
RESIDUAL_STREAMS = (
    (re.compile(r"language_model\.layers\.(\d+)\."), ("o_proj.weight", "down_proj.weight", "experts.down_proj")),
    (re.compile(r"(?:^|\.)blocks\.(\d+)\."), ("attn.proj.weight", "mlp.linear_fc2.weight")),
)


@torch.no_grad()
def randomise_(module: torch.nn.Module, seed: int, std: float = 0.02, spread_routing: bool = True) -> None:
    """Normal(0, std) weights, unit norm scales, zero biases, in place on the module's device; with
    `spread_routing`, the embeddings at Normal(0, EMBEDDING_STD) and each residual stream's output
    projections at Normal(0, std / sqrt(2 * its layers)) (see above)."""
    generator = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    named = list(module.named_parameters())
    output_std = {}  # parameter name -> its std, for the residual streams' output projections
    for layer, outputs in RESIDUAL_STREAMS if spread_routing else ():
        depth = len({int(match.group(1)) for name, _ in named if (match := layer.search(name))})
        output_std.update({name: std / math.sqrt(2 * depth) for name, _ in named
                           if layer.search(name) and name.endswith(outputs)})
    for name, parameter in named:
        if name.endswith("bias"):
            parameter.zero_()
        elif "norm" in name or parameter.dim() == 1:
            parameter.fill_(1.0)
        elif spread_routing and name.endswith(EMBEDDINGS):
            parameter.normal_(0.0, EMBEDDING_STD, generator=generator)
        else:
            parameter.normal_(0.0, output_std.get(name, std), generator=generator)


def random_model(checkpoint_dir: Path, device: str | torch.device, dtype: torch.dtype, seed: int = 0,
                 spread_routing: bool = True) -> Qwen3VLMoeModel:
    """Our model for `checkpoint_dir`'s config, allocated on `device` with random weights (`randomise_`)."""
    config = ModelConfig.from_pretrained(checkpoint_dir)
    with torch.device("meta"):
        model = Qwen3VLMoeModel(config)
    model = model.to(dtype).to_empty(device=torch.device(device))
    model.visual.reset_rotary_buffers()
    model.language_model.reset_rotary_buffers()
    if config.tie_word_embeddings:
        model.lm_head.weight = model.language_model.embed_tokens.weight
    randomise_(model, seed, spread_routing=spread_routing)
    return model.requires_grad_(False).eval()


def random_vision_tower(checkpoint_dir: Path, device: str | torch.device, dtype: torch.dtype, seed: int = 0):
    """Only our vision tower for `checkpoint_dir`'s config, with random weights on `device`
    (the vision benchmark does not need the 60 GB text model)."""
    from vlm_catalog.model.vision import VisionTower

    config = ModelConfig.from_pretrained(checkpoint_dir)
    with torch.device("meta"):
        tower = VisionTower(config.vision)
    tower = tower.to(dtype).to_empty(device=torch.device(device))
    tower.reset_rotary_buffers()
    randomise_(tower, seed)
    return tower.requires_grad_(False).eval()


def random_transformers_model(checkpoint_dir: Path, device: str | torch.device, dtype: torch.dtype, seed: int = 0):
    """transformers' Qwen3VLMoeForConditionalGeneration (sdpa attention) with random weights on `device`."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    config = Qwen3VLMoeConfig.from_pretrained(str(checkpoint_dir))
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = Qwen3VLMoeForConditionalGeneration(config)
    model = model.to(dtype).to_empty(device=torch.device(device))
    for module in model.modules():  # rotary buffers were wiped by to_empty
        if hasattr(module, "inv_freq") and hasattr(module, "compute_default_rope_parameters"):
            inv_freq, _ = module.compute_default_rope_parameters(module.config, device=torch.device(device))
            module.inv_freq = inv_freq.to(device)
        elif hasattr(module, "inv_freq") and hasattr(module, "compute_axial_rope_parameters"):
            inv_freq, _ = module.compute_axial_rope_parameters(module.config, device=torch.device(device))
            module.inv_freq = inv_freq.to(device)
    randomise_(model, seed)
    return model.requires_grad_(False).eval()
