"""Our Qwen3-VL-MoE against transformers on tiny random checkpoints.

Tolerance: float32 logits within 1e-4 (max abs) at every prompt position and
every decode step, and identical greedy tokens for 32 steps.
"""

import pytest
import torch

from tests.model.helpers import build_checkpoint, noise_image, reference_without_renormalisation
from vlm_catalog.model.config import ModelConfig
from vlm_catalog.model.loader import load_model
from vlm_catalog.model.parity import build_messages, load_reference, our_greedy, reference_greedy
from vlm_catalog.preprocess.processor import PromptProcessor

ATOL = 1e-4
STEPS = 32

CASES = {
    # name: (spec changes, image sizes (width, height))
    "top2_gqa2_two_images": ({}, [(200, 90), (64, 64)]),
    "top1_very_small_image": ({"experts_per_token": 1}, [(37, 23)]),
    "top4_no_renormalisation": ({"experts_per_token": 4, "norm_topk_prob": False}, [(96, 160)]),
    "gqa1_tied_embeddings": ({"num_kv_heads": 4, "tie_word_embeddings": True}, [(130, 70)]),
    "gqa4_no_deepstack": ({"num_heads": 8, "num_kv_heads": 2, "deepstack_visual_indexes": ()}, [(64, 200)]),
    "deepstack_three_layers_dense_layer": (
        {"text_layers": 3, "vision_depth": 3, "deepstack_visual_indexes": (0, 1, 2), "mlp_only_layers": (1,)},
        [(120, 120)],
    ),
    "text_only": ({}, []),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers(case, tmp_path, tiny_tokenizer):
    changes, image_sizes = CASES[case]
    checkpoint = build_checkpoint(tmp_path / case, tiny_tokenizer, seed=len(case), **changes)
    config = ModelConfig.from_pretrained(checkpoint)
    processor = PromptProcessor.from_pretrained(checkpoint, image_token_id=config.image_token_id)
    images = [noise_image(w, h, seed=i) for i, (w, h) in enumerate(image_sizes)]
    prompt = processor.process(build_messages("What is this product? Answer in JSON.", images))
    assert len(prompt.images) == len(images)

    ours = load_model(checkpoint)
    reference = load_reference(checkpoint, torch.float32)
    if not changes.get("norm_topk_prob", True):
        reference_without_renormalisation(reference)

    pixels = processor.load_pixels(prompt.images) if images else None
    our_tokens, our_logits = our_greedy(ours, prompt, pixels, STEPS)
    reference_tokens, reference_logits = reference_greedy(reference, prompt, pixels, STEPS)
    assert len(our_logits) == len(reference_logits) == prompt.num_tokens + STEPS - 1
    worst = max(float((a - b).abs().max()) for a, b in zip(our_logits, reference_logits))
    assert worst <= ATOL, f"max abs logit difference {worst:.2e}"
    assert our_tokens == reference_tokens
    assert len(set(our_tokens)) > 1  # the comparison is not vacuous: the model does not repeat one token
