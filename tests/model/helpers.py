"""Helpers for model tests: tiny checkpoints, test images, a transformers reference with options."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

from vlm_catalog.model.tiny_checkpoint import TinySpec, make_tiny_checkpoint


def noise_image(width: int, height: int, seed: int, fmt: str = "PNG") -> bytes:
    """A smooth-plus-noise RGB image, encoded (PNG keeps pixels exact)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([np.sin(x / 7.0 + seed), np.cos(y / 5.0), np.sin((x + y) / 11.0)], axis=-1)
    pixels = (base * 80 + 128 + rng.normal(0, 25, (height, width, 3))).clip(0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def build_checkpoint(directory: Path, tokenizer, seed: int = 0, **changes) -> Path:
    return make_tiny_checkpoint(directory, TinySpec().with_changes(**changes), seed=seed, tokenizer=tokenizer)


def reference_without_renormalisation(reference) -> None:
    """Swap transformers' Qwen3-VL-MoE routers (always renormalise) for its Qwen3-MoE router
    with norm_topk_prob=False, the reference for checkpoints that turn renormalisation off."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    text = reference.config.text_config
    for layer in reference.model.language_model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is None:
            continue
        router = Qwen3MoeTopKRouter(
            SimpleNamespace(
                num_experts_per_tok=text.num_experts_per_tok,
                num_experts=text.num_experts,
                norm_topk_prob=False,
                hidden_size=text.hidden_size,
            )
        )
        with torch.no_grad():
            router.weight.copy_(gate.weight)
        layer.mlp.gate = router.to(gate.weight.dtype)
