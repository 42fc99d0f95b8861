"""Build small Qwen3-VL-MoE checkpoints locally, for tests and the CPU demo.

Nothing is downloaded: a byte-level BPE tokenizer with Qwen's special tokens is
trained on a built-in corpus (the mlperf prompt, JSON, the taxonomy subset), a
small random `Qwen3VLMoeConfig` is instantiated in transformers and saved with
`save_pretrained`, next to `preprocessor_config.json`, a chat template and a
generation config. Both transformers and our loader read the result.

`scripts/make_tiny_checkpoint.py` is the command-line front of this module.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from vlm_catalog.error_text import one_line
from vlm_catalog.preprocess.chat_template import BUILTIN_QWEN3_VL_TEMPLATE as CHAT_TEMPLATE

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2/3 pre-tokenisation: letters runs, single digits, punctuation runs, newlines, spaces.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TinySpecError(ValueError):
    """Shapes no working checkpoint has; the message names the setting."""


@dataclass(frozen=True)
class TinySpec:
    """Shapes of a tiny Qwen3-VL-MoE. Defaults: 2 text layers, 8 experts top-2, GQA 2."""

    text_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    num_experts: int = 8
    experts_per_token: int = 2
    moe_intermediate_size: int = 32
    intermediate_size: int = 96
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    mrope_section: tuple[int, int, int] = (4, 2, 2)
    rope_theta: float = 5_000_000.0
    tie_word_embeddings: bool = False
    vision_depth: int = 2
    vision_hidden_size: int = 32
    vision_heads: int = 2
    vision_intermediate_size: int = 64
    num_position_embeddings: int = 64
    deepstack_visual_indexes: tuple[int, ...] = (0, 1)
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    min_pixels: int = 32 * 32
    max_pixels: int = 512 * 512
    init_std: float = 0.08
    tokenizer_vocab_size: int = 1024

    def __post_init__(self) -> None:
        """Refuse each setting out of its own range (`TinySpecError`); how the shapes fit together
        (an even head_dim, mrope_section summing to half of it, ...) is `hf_config`'s to check."""
        for spec_field in fields(self):
            value = getattr(self, spec_field.name)
            least = 0 if spec_field.name == "num_experts" else 1  # no experts: dense MLPs
            if spec_field.type == "int" and not (type(value) is int and value >= least):
                raise TinySpecError(f"{spec_field.name} must be an integer of at least {least}, got {value!r}")
        if self.max_pixels < self.min_pixels:
            raise TinySpecError(f"max_pixels {self.max_pixels} is below min_pixels {self.min_pixels}")
        if not (0 < self.rope_theta < math.inf and 0 <= self.init_std < math.inf):  # NaN fails too
            raise TinySpecError(f"rope_theta must be a finite number above 0 and init_std a finite one of at "
                                f"least 0, got {self.rope_theta} and {self.init_std}")
        for name, layers in (("mlp_only_layers", self.text_layers), ("deepstack_visual_indexes", self.vision_depth)):
            if not all(type(index) is int and 0 <= index < layers for index in getattr(self, name)):
                raise TinySpecError(f"{name} must be layer indexes from 0 to {layers - 1}, got {getattr(self, name)}")

    def with_changes(self, **changes) -> TinySpec:
        return replace(self, **changes)


@dataclass
class TokenizerCorpus:
    """Text the tiny tokenizer is trained on; extend `extra` to cover a domain."""

    extra: list[str] = field(default_factory=list)

    def texts(self) -> list[str]:
        from schemas import ProductDetails, ProductMetadata
        from vlm_catalog.paths import TAXONOMY_FILE
        from vlm_catalog.preprocess.prompt import mlperf_system_prompt

        texts = [mlperf_system_prompt(ProductMetadata), mlperf_system_prompt(ProductDetails)]
        texts.append(
            "The title of the product is the following:\n```text\n\n```\n\n"
            "The description of the product is the following:\n```text\n\n```\n\n"
            "The following are the possible product categories:\n```json\n['', '']\n```\n"
        )
        texts.append('{"category":"","brand":"","is_secondhand":true}{"is_secondhand":false}')
        texts.append("<div class=\"product\"><p>pre-owned refurbished new used by brand</p></div>")
        texts.append("<script>var x = {\"@type\": \"Product\"};</script><style>.a{color:red}</style>")
        texts.append("0123456789 " * 4)
        if TAXONOMY_FILE.is_file():
            texts.extend(
                line for line in TAXONOMY_FILE.read_text(encoding="utf-8").splitlines()
                if line and not line.startswith("#")
            )
        return texts + self.extra


def build_tokenizer(vocab_size: int = 1024, corpus: TokenizerCorpus | None = None):
    """Train a byte-level BPE tokenizer with Qwen's special tokens; returns a transformers tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(QWEN_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator((corpus or TokenizerCorpus()).texts(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[t for t in QWEN_SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")],
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )


def hf_config(spec: TinySpec, tokenizer):
    """A transformers `Qwen3VLMoeConfig` for `spec`, with token ids from `tokenizer`.

    `TinySpecError` where transformers or our engine (`ModelConfig`) would refuse the shapes
    together (head_dim 7: RoPE needs an even one; more experts per token than experts)."""
    from vlm_catalog.model.config import ModelConfig

    try:  # transformers' own validation error is no ValueError
        config = _qwen3_vl_moe_config(spec, tokenizer)
        ModelConfig.from_hf(config)  # a `ModelConfigError`
    except Exception as exc:  # noqa: BLE001 - any of them means: no checkpoint from these shapes
        raise TinySpecError(f"these shapes make no working checkpoint: {one_line(exc)}") from None
    return config


def _qwen3_vl_moe_config(spec: TinySpec, tokenizer):
    from transformers import Qwen3VLMoeConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_SPECIAL_TOKENS}
    vocab_size = -(-len(tokenizer) // 64) * 64  # padded like Qwen's 151936, never sampled by the grammar
    return Qwen3VLMoeConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=spec.hidden_size,
            num_hidden_layers=spec.text_layers,
            num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            intermediate_size=spec.intermediate_size,
            moe_intermediate_size=spec.moe_intermediate_size,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.experts_per_token,
            norm_topk_prob=spec.norm_topk_prob,
            decoder_sparse_step=spec.decoder_sparse_step,
            mlp_only_layers=list(spec.mlp_only_layers),
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": spec.rope_theta,
                "mrope_section": list(spec.mrope_section),
                "mrope_interleaved": True,
            },
            initializer_range=spec.init_std,
            bos_token_id=None,
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
        ),
        vision_config=dict(
            depth=spec.vision_depth,
            hidden_size=spec.vision_hidden_size,
            intermediate_size=spec.vision_intermediate_size,
            num_heads=spec.vision_heads,
            out_hidden_size=spec.hidden_size,
            num_position_embeddings=spec.num_position_embeddings,
            deepstack_visual_indexes=list(spec.deepstack_visual_indexes),
            patch_size=spec.patch_size,
            temporal_patch_size=spec.temporal_patch_size,
            spatial_merge_size=spec.spatial_merge_size,
            initializer_range=spec.init_std,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=spec.tie_word_embeddings,
    )


def preprocessor_config(spec: TinySpec) -> dict:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "patch_size": spec.patch_size,
        "temporal_patch_size": spec.temporal_patch_size,
        "merge_size": spec.spatial_merge_size,
        "size": {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
    }


def make_tiny_checkpoint(
    out_dir: str | Path,
    spec: TinySpec = TinySpec(),
    seed: int = 0,
    tokenizer=None,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
) -> Path:
    """Write a complete random-weight checkpoint directory; returns its path. Shapes that make no
    working checkpoint are a `TinySpecError` raised before anything is written."""
    from transformers import GenerationConfig, Qwen3VLMoeForConditionalGeneration

    out_dir = Path(out_dir)
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer(spec.tokenizer_vocab_size)
    config = hf_config(spec, tokenizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    random.seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(config).to(dtype).eval()
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **save_kwargs)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(spec), indent=2))
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    GenerationConfig(eos_token_id=eos, pad_token_id=eos[1], do_sample=False).save_pretrained(out_dir)
    (out_dir / "tiny_spec.json").write_text(json.dumps({"seed": seed, **asdict(spec)}, indent=2))
    return out_dir
