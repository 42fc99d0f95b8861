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


FP8_SKIPPED = ("visual.", "lm_head", "embed_tokens", "norm", ".mlp.gate.weight")  # kept unquantized, as Qwen's


def write_fp8_checkpoint(source: Path, fp8_dir: Path, widened_dir: Path, block: tuple[int, int]) -> None:
    """Qwen's -FP8 layout from an unquantized checkpoint: every language-model linear weight as
    float8 e4m3 plus `<name>_scale_inv` block scales, experts as per-expert tensors, and
    `quantization_config` in config.json. `widened_dir` gets the same model unquantized, each
    weight being exactly Q * scale: the checkpoint an FP8 load must reproduce."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from kernels.fp8 import dequantize, quantize

    tensors = load_file(str(source / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    widened: dict[str, torch.Tensor] = {}

    def add(name: str, weight: torch.Tensor) -> None:
        q, scale = quantize(weight, block)
        quantized[name], quantized[name + "_scale_inv"] = q, scale
        widened[name] = dequantize(q, scale, block, weight.dtype)

    for name, tensor in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H] -> per expert gate / up [I, H]
            prefix, size = name.removesuffix("gate_up_proj"), tensor.shape[1] // 2
            for expert, weight in enumerate(tensor):
                add(f"{prefix}{expert}.gate_proj.weight", weight[:size])
                add(f"{prefix}{expert}.up_proj.weight", weight[size:])
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            prefix = name.removesuffix("down_proj")
            for expert, weight in enumerate(tensor):
                add(f"{prefix}{expert}.down_proj.weight", weight)
        elif tensor.dim() == 2 and name.endswith(".weight") and not any(part in name for part in FP8_SKIPPED):
            add(name, tensor)
        else:
            quantized[name] = widened[name] = tensor
    for directory, contents in ((fp8_dir, quantized), (widened_dir, widened)):
        shutil.copytree(source, directory)
        (directory / "model.safetensors").unlink()
        save_file({name: t.contiguous() for name, t in contents.items()}, str(directory / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2))
