"""Engine test fixtures: one tiny checkpoint per session, transformers as the reference."""

import random

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


def run_waves_with_aborts(engine, waves: int, per_wave: int, rng: random.Random, check_output=None) -> int:
    """Add `waves` waves of `per_wave` short requests (1-5 tokens each); step each wave to the
    end, aborting 0-3 random live requests before every step. Returns the outputs that finished;
    `check_output(output)` sees every output."""
    from vlm_catalog import SamplingParams

    finished = 0
    for wave in range(waves):
        for index in range(wave * per_wave, (wave + 1) * per_wave):
            messages = [{"role": "user", "content": f"short {index % 17} " * rng.randrange(1, 6)}]
            engine.add_request(messages, SamplingParams(max_tokens=rng.randrange(1, 6), ignore_eos=True), f"r{index}")
        while engine.has_unfinished_requests():
            live = list(engine.requests)
            for request_id in rng.sample(live, k=min(len(live), rng.randrange(0, 4))):
                engine.abort(request_id)
            for output in engine.step():
                if check_output is not None:
                    check_output(output)
                finished += output.finished
    return finished
