"""Check our model against transformers' `Qwen3VLMoeForConditionalGeneration` on one checkpoint.

Both models get the same token ids, pixel rows and grids (from our
`PromptProcessor`, itself tested equal to transformers' processor). We compare
the logits of every prompt position, then decode `num_tokens` tokens greedily
with each model (no stop tokens) and compare the logits of every step and the
tokens chosen. `vlm-catalog check-parity` is the command-line front.

Pass criteria. float32: max abs logit difference <= atol (1e-4) and identical
greedy tokens. bfloat16/float16: rounding alone moves logits by ~1e-1 (transformers'
bf16 logits differ from its float32 ones by that much), so both models are also
compared with transformers in float32: ours must be no further from it than
1.5x transformers' own low-precision error (+ atol), with greedy tokens equal to
transformers' in the same dtype, up to a near-tie: where the tokens first differ,
transformers' own logits may rate ours within that bound of its choice (an exact
tie of its top two is common in bfloat16, whose logits near 10 step by 1/16).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlm_catalog.model.attention import ContiguousKVCache
from vlm_catalog.model.config import ModelConfig
from vlm_catalog.model.loader import load_model
from vlm_catalog.model.qwen3_vl_moe import Qwen3VLMoeModel, multimodal_inputs
from vlm_catalog.preprocess.processor import ProcessedPrompt, PromptProcessor

Pixels = tuple[torch.Tensor, torch.Tensor] | None  # (pixel rows [N, D], grids [n, 3]) or no images


LOW_PRECISION_SLACK = 1.5


@dataclass
class ParityReport:
    prompt_tokens: int
    num_images: int
    max_abs_logit_diff: float  # ours vs transformers, same dtype
    ours: list[int]
    reference: list[int]
    step_diffs: list[float] = field(default_factory=list)
    # low precision only: distance of each model's logits from transformers in float32
    our_error_vs_float32: float | None = None
    reference_error_vs_float32: float | None = None
    # low precision only: at the first differing token, transformers' logit of its token minus its
    # logit of ours (0 for an exact tie of the two)
    reference_margin_at_difference: float | None = None

    @property
    def tokens_match(self) -> bool:
        return self.ours == self.reference

    @property
    def first_difference(self) -> int | None:
        return next((i for i, (a, b) in enumerate(zip(self.ours, self.reference)) if a != b), None)

    def low_precision_bound(self, atol: float) -> float:
        return LOW_PRECISION_SLACK * self.reference_error_vs_float32 + atol

    def near_tie(self, atol: float) -> bool:
        """The tokens differ first where transformers' own logits rate ours within the low-precision bound."""
        margin = self.reference_margin_at_difference
        return margin is not None and margin <= self.low_precision_bound(atol)

    def passed(self, atol: float) -> bool:
        if self.our_error_vs_float32 is None:
            return self.tokens_match and self.max_abs_logit_diff <= atol
        return (self.tokens_match or self.near_tie(atol)) and self.our_error_vs_float32 <= self.low_precision_bound(atol)


class ReferenceUnavailable(RuntimeError):
    """transformers cannot load this checkpoint here (e.g. FP8 without accelerate or a GPU)."""


def load_reference(checkpoint_dir: str | Path, dtype: torch.dtype, device: str = "cpu") -> Any:
    from transformers import Qwen3VLMoeForConditionalGeneration

    try:
        model = Qwen3VLMoeForConditionalGeneration.from_pretrained(
            str(checkpoint_dir), dtype=dtype, attn_implementation="eager"
        )
    except (ImportError, RuntimeError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ReferenceUnavailable(
            f"transformers cannot load {checkpoint_dir} as the reference here ({first_line}); "
            "for an FP8 checkpoint, check its unquantized original instead"
        ) from None
    return model.to(device).eval()


def build_messages(prompt: str, images: list[bytes]) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "image", "image": image} for image in images]
    content.append({"type": "text", "text": prompt})
    return [{"role": "user", "content": content}]


@torch.inference_mode()
def reference_greedy(
    reference: Any, prompt: ProcessedPrompt, pixels: Pixels, num_tokens: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and per-step logits [V] (prompt positions first) from transformers, with its KV cache."""
    device = next(reference.parameters()).device
    input_ids = torch.tensor([prompt.token_ids.tolist()], device=device)
    kwargs: dict[str, Any] = {}
    if pixels is not None:
        kwargs["pixel_values"] = pixels[0].to(device)
        kwargs["image_grid_thw"] = pixels[1].to(device)
        kwargs["mm_token_type_ids"] = (input_ids == reference.config.image_token_id).int()
    reference.model.rope_deltas = None
    out = reference(input_ids=input_ids, use_cache=True, **kwargs)
    logits = [row for row in out.logits[0].float()]
    cache = out.past_key_values
    tokens: list[int] = []
    for step in range(num_tokens):
        token = int(logits[-1].argmax())
        tokens.append(token)
        if step == num_tokens - 1:
            break
        # no position_ids: transformers derives them from the rope deltas of its prefill,
        # an independent check of our mrope delta
        out = reference(input_ids=torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits[0, -1].float())
    return tokens, logits


@torch.inference_mode()
def our_greedy(
    model: Qwen3VLMoeModel, prompt: ProcessedPrompt, pixels: Pixels, num_tokens: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and per-step logits from our model, with the unpaged KV cache."""
    device = model.device
    cache = ContiguousKVCache(model.config.text.num_layers)
    input_ids = torch.tensor(prompt.token_ids.tolist(), device=device)
    images = []
    if pixels is not None:
        images = model.encode_images(pixels[0].to(device), pixels[1].to(device))
    cache.plan(["prompt"], [len(prompt.token_ids)])
    hidden = model(input_ids, prompt.positions.to(device), cache, multimodal_inputs(input_ids, model.config.image_token_id, images))
    logits = [row for row in model.compute_logits(hidden).float()]
    tokens: list[int] = []
    length = len(prompt.token_ids)
    for step in range(num_tokens):
        token = int(logits[-1].argmax())
        tokens.append(token)
        if step == num_tokens - 1:
            break
        cache.plan(["prompt"], [1])
        position = torch.full((3, 1), length + step + prompt.mrope_delta, device=device)
        hidden = model(torch.tensor([token], device=device), position, cache)
        logits.append(model.compute_logits(hidden)[0].float())
    return tokens, logits


def check_parity(
    checkpoint_dir: str | Path,
    prompt_text: str = "Describe the product in one sentence.",
    images: list[bytes] | None = None,
    num_tokens: int = 32,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> ParityReport:
    config = ModelConfig.from_pretrained(checkpoint_dir)
    if not config.text.norm_topk_prob:
        raise ReferenceUnavailable(
            "config.json sets norm_topk_prob to false: this engine then leaves the top-k routing weights "
            "unnormalised, as vLLM does, but transformers' Qwen3-VL-MoE ignores the flag (its router always "
            "renormalises), so it is no reference for this checkpoint"
        )
    processor = PromptProcessor.from_pretrained(checkpoint_dir, image_token_id=config.image_token_id, vision=config.vision)
    prompt = processor.process(build_messages(prompt_text, images or []))
    pixels = processor.load_pixels(prompt.images) if prompt.images else None
    ours = load_model(checkpoint_dir, dtype=dtype, device=device)
    reference = load_reference(checkpoint_dir, dtype=dtype, device=device)
    our_tokens, our_logits = our_greedy(ours, prompt, pixels, num_tokens)
    reference_tokens, reference_logits = reference_greedy(reference, prompt, pixels, num_tokens)
    step_diffs = _step_diffs(our_logits, reference_logits)
    report = ParityReport(
        prompt_tokens=prompt.num_tokens,
        num_images=len(prompt.images),
        max_abs_logit_diff=max(step_diffs),
        ours=our_tokens,
        reference=reference_tokens,
        step_diffs=step_diffs,
    )
    if dtype != torch.float32:
        del reference
        float32_reference = load_reference(checkpoint_dir, torch.float32, device=device)
        float32_tokens, float32_logits = reference_greedy(float32_reference, prompt, pixels, num_tokens)
        # compare only while all three runs fed the same tokens back in
        agreeing = _common_prefix(our_tokens, reference_tokens, float32_tokens)
        rows = prompt.num_tokens + max(agreeing - 1, 0)
        report.our_error_vs_float32 = max(_step_diffs(our_logits[:rows], float32_logits[:rows]))
        report.reference_error_vs_float32 = max(_step_diffs(reference_logits[:rows], float32_logits[:rows]))
        step = report.first_difference
        if step is not None:  # the row whose argmax chose the step's token
            row = reference_logits[prompt.num_tokens - 1 + step]
            report.reference_margin_at_difference = float(row[reference_tokens[step]] - row[our_tokens[step]])
    return report


def _common_prefix(*sequences: list[int]) -> int:
    length = 0
    for items in zip(*sequences):
        if len(set(items)) != 1:
            break
        length += 1
    return length


def _step_diffs(first: list[torch.Tensor], second: list[torch.Tensor]) -> list[float]:
    return [float((a.float() - b.float()).abs().max()) for a, b in zip(first, second)]
