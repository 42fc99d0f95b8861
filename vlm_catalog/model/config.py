"""Model configuration: the fields our Qwen3-VL-MoE code reads, parsed from `config.json`.

Parsing goes through transformers' `Qwen3VLMoeConfig`, which fills defaults and
maps the legacy `rope_scaling` + `rope_theta` keys of the published checkpoints
onto `rope_parameters`. What the model needs is then copied into frozen
dataclasses, so nothing downstream depends on transformers' config objects.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlm_catalog.error_text import one_line
from vlm_catalog.lfs_pointer import first_lfs_pointer, pointer_message
from vlm_catalog.model.fp8 import Fp8BlockQuantization
from vlm_catalog.paths import shipped_data_hint

SUPPORTED_MODEL_TYPES = ("qwen3_vl_moe",)


class ModelConfigError(ValueError):
    """A checkpoint configuration we cannot serve; the message says which field."""


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    hidden_act: str
    rope_theta: float

    def __post_init__(self) -> None:
        if self.hidden_act != "gelu_pytorch_tanh":
            raise ModelConfigError(f"vision hidden_act {self.hidden_act!r} is not supported (only 'gelu_pytorch_tanh')")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened pixel row: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    attention_bias: bool
    hidden_act: str
    max_position_embeddings: int | None = None  # the longest context the checkpoint was made for

    def __post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise ModelConfigError(f"text hidden_act {self.hidden_act!r} is not supported (only 'silu')")

    def is_moe_layer(self, layer_index: int) -> bool:
        """Same rule as transformers' decoder layer: sparse unless listed as MLP-only."""
        return (
            layer_index not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_index + 1) % self.decoder_sparse_step == 0
        )


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    tie_word_embeddings: bool
    quantization: Fp8BlockQuantization | None = None  # an FP8 block-quantized checkpoint

    def __post_init__(self) -> None:
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ModelConfigError(
                f"vision out_hidden_size {self.vision.out_hidden_size} differs from the text "
                f"hidden_size {self.text.hidden_size}"
            )

    @classmethod
    def from_pretrained(cls, checkpoint_dir: str | Path) -> ModelConfig:
        path = Path(checkpoint_dir) / "config.json"
        if not path.is_file():
            raise ModelConfigError(
                f"{path} not found: a checkpoint directory needs config.json{shipped_data_hint(checkpoint_dir)}"
            )
        pointer = first_lfs_pointer(sorted(Path(checkpoint_dir).iterdir()))  # every front door reads this first
        if pointer is not None:
            raise ModelConfigError(pointer_message(pointer))
        try:
            raw = json.loads(path.read_bytes())  # JSON is UTF-8 whatever the locale
        except ValueError as exc:  # not JSON, or not UTF-8
            raise ModelConfigError(f"{path}: not valid JSON ({getattr(exc, 'msg', exc)})") from None
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{path}: holds a JSON {type(raw).__name__}, not an object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"unsupported model_type {model_type!r}; this engine serves "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints"
            )
        from transformers import Qwen3VLMoeConfig

        quantization = parse_quantization(raw.get("quantization_config"))
        try:  # transformers checks the fields' types (a TypeError, or its own validation error)
            hf = Qwen3VLMoeConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "quantization_config")})
        except Exception as exc:  # noqa: BLE001 - any of them means: not a config we can read
            raise ModelConfigError(f"config.json is not a valid {model_type} config: {one_line(exc)}") from None
        config = cls.from_hf(hf)
        return dataclasses.replace(config, quantization=quantization) if quantization else config

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Build from a transformers `Qwen3VLMoeConfig` (already parsed)."""
        text, vision = hf.text_config, hf.vision_config
        rope = dict(text.rope_parameters or {})
        if rope.get("rope_type", "default") != "default":
            raise ModelConfigError(
                f"text rope_type {rope.get('rope_type')!r} is not supported (only 'default' MRoPE)"
            )
        head_dim = text.head_dim or text.hidden_size // text.num_attention_heads
        mrope_section = tuple(rope.get("mrope_section", (24, 20, 20)))
        if len(mrope_section) != 3 or sum(mrope_section) != head_dim // 2 or min(mrope_section) < 0:
            raise ModelConfigError(
                f"mrope_section {list(mrope_section)} must have 3 entries, none negative, summing to "
                f"head_dim / 2 = {head_dim // 2}"
            )
        if rope.get("mrope_interleaved") is False:
            raise ModelConfigError("non-interleaved MRoPE (Qwen2-VL style) is not supported")
        if text.num_attention_heads % text.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads {text.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {text.num_key_value_heads}"
            )
        vision_heads = vision.num_heads
        if vision.hidden_size % vision_heads:
            raise ModelConfigError(
                f"vision hidden_size {vision.hidden_size} is not divisible by num_heads {vision_heads}"
            )
        if (vision.hidden_size // vision_heads) % 4:
            raise ModelConfigError(
                f"vision head_dim {vision.hidden_size // vision_heads} (hidden_size / num_heads) is not a "
                "multiple of 4: the tower's 2D rotary embedding splits it into height and width halves of pairs"
            )
        if vision.in_channels != 3:
            raise ModelConfigError(f"vision in_channels {vision.in_channels}: images are read as RGB, 3 channels")
        if text.num_experts > 0:  # transformers divides by the step, and selects top-k of the experts
            if text.decoder_sparse_step < 1:
                raise ModelConfigError(f"decoder_sparse_step {text.decoder_sparse_step} must be at least 1")
            if not 1 <= text.num_experts_per_tok <= text.num_experts:
                raise ModelConfigError(
                    f"num_experts_per_tok {text.num_experts_per_tok} must be between 1 and num_experts "
                    f"{text.num_experts}"
                )
        side = int(round(vision.num_position_embeddings**0.5))
        if side * side != vision.num_position_embeddings:
            raise ModelConfigError(
                f"vision num_position_embeddings {vision.num_position_embeddings} is not a square"
            )
        return cls(
            model_type=hf.model_type,
            text=TextConfig(
                vocab_size=text.vocab_size,
                hidden_size=text.hidden_size,
                num_layers=text.num_hidden_layers,
                num_heads=text.num_attention_heads,
                num_kv_heads=text.num_key_value_heads,
                head_dim=head_dim,
                intermediate_size=text.intermediate_size,
                moe_intermediate_size=text.moe_intermediate_size,
                num_experts=text.num_experts,
                num_experts_per_tok=text.num_experts_per_tok,
                # transformers' Qwen3-VL-MoE router always renormalises; checkpoints say
                # norm_topk_prob: true. We honour the flag when a config sets it, as vLLM does
                # (check-parity then has no reference: model/parity.py).
                norm_topk_prob=bool(getattr(text, "norm_topk_prob", True)),
                decoder_sparse_step=text.decoder_sparse_step,
                mlp_only_layers=tuple(text.mlp_only_layers or ()),
                rms_norm_eps=text.rms_norm_eps,
                rope_theta=float(rope.get("rope_theta", 5_000_000.0)),
                mrope_section=mrope_section,  # type: ignore[arg-type]
                attention_bias=bool(text.attention_bias),
                hidden_act=text.hidden_act,
                max_position_embeddings=getattr(text, "max_position_embeddings", None),
            ),
            vision=VisionConfig(
                depth=vision.depth,
                hidden_size=vision.hidden_size,
                intermediate_size=vision.intermediate_size,
                num_heads=vision_heads,
                in_channels=vision.in_channels,
                patch_size=vision.patch_size,
                temporal_patch_size=vision.temporal_patch_size,
                spatial_merge_size=vision.spatial_merge_size,
                out_hidden_size=vision.out_hidden_size,
                num_position_embeddings=vision.num_position_embeddings,
                deepstack_visual_indexes=tuple(vision.deepstack_visual_indexes),
                hidden_act=vision.hidden_act,
                rope_theta=float((vision.rope_parameters or {}).get("rope_theta", 10_000.0)),
            ),
            image_token_id=hf.image_token_id,
            video_token_id=hf.video_token_id,
            vision_start_token_id=hf.vision_start_token_id,
            vision_end_token_id=hf.vision_end_token_id,
            # transformers ties lm_head to the embeddings by the top-level flag only
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        )


def parse_quantization(raw: Any) -> Fp8BlockQuantization | None:
    """config.json's `quantization_config`: none, or block-wise FP8 (vlm_catalog/model/fp8.py)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"quantization_config must be an object, got {type(raw).__name__}")
    method = raw.get("quant_method")
    if method != "fp8":
        raise ModelConfigError(
            f"quantization_config: quant_method {method!r} is not supported (only block-wise 'fp8', "
            "the format of Qwen's -FP8 checkpoints; or use the unquantized checkpoint)"
        )
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise ModelConfigError(
            f"quantization_config: activation_scheme {raw.get('activation_scheme')!r} is not supported (only "
            "'dynamic', as in Qwen's -FP8 checkpoints: static input scales would be ignored)"
        )
    if raw.get("fmt", "e4m3") != "e4m3":
        raise ModelConfigError(f"quantization_config: fmt {raw.get('fmt')!r} is not supported (only 'e4m3')")
    block = raw.get("weight_block_size")
    if (
        not isinstance(block, list | tuple) or len(block) != 2
        or not all(isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in block)
    ):
        raise ModelConfigError(
            f"quantization_config: weight_block_size must be two positive integers (e.g. [128, 128]), got {block!r}; "
            "per-tensor FP8 is not supported"
        )
    return Fp8BlockQuantization(block_n=block[0], block_k=block[1])
