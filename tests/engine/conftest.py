"""Engine test fixtures: one tiny checkpoint per session, transformers as the reference."""

import pytest
import torch

from tests.model.helpers import build_checkpoint, noise_image
from vlm_catalog.model.tiny_checkpoint import build_tokenizer


@pytest.fixture(scope="session")
def engine_checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("engine") / "tiny", build_tokenizer(1000), seed=5)


@pytest.fixture(scope="session")
def reference_model(engine_checkpoint):
    from vlm_catalog.model.parity import load_reference

    return load_reference(engine_checkpoint, torch.float32)


def conversation(index: int, images: int = 0, words: int = 5, system: str | None = None) -> list[dict]:
    content = [{"type": "image", "image": noise_image(48 + 37 * ((index + k) % 5), 40 + 23 * k, seed=100 * index + k)} for k in range(images)]
    content.append({"type": "text", "text": f"Item {index}: " + " ".join(f"word{(index * 7 + j) % 13}" for j in range(words))})
    messages = [{"role": "user", "content": content}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return messages


def mixed_conversations(count: int = 8) -> list[list[dict]]:
    """Mixed prompt lengths: text-only, one image, two images."""
    return [conversation(i, images=i % 3, words=3 + 9 * (i % 4)) for i in range(count)]


def transformers_generate(reference, processor, messages, max_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers' `generate`, never stopping early."""
    prompt = processor.process(messages)
    input_ids = torch.tensor([prompt.token_ids.tolist()])
    kwargs = {"attention_mask": torch.ones_like(input_ids)}
    if prompt.images:
        pixel_values, grids = processor.load_pixels(prompt.images)
        kwargs.update(pixel_values=pixel_values, image_grid_thw=grids,
                      mm_token_type_ids=(input_ids == reference.config.image_token_id).int())
    reference.model.rope_deltas = None
    # eos_token_id=[] turns stopping off (None would fall back to the checkpoint's EOS ids)
    output = reference.generate(
        input_ids=input_ids, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=[], pad_token_id=0, **kwargs
    )
    return output[0, input_ids.shape[1]:].tolist()
