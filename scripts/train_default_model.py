#!/usr/bin/env python
"""Train the shipped default model on synthetic catalogue extraction (CPU, ~40 min).

Starts from the random checkpoint of `scripts/make_default_model.py`, trains it
with transformers' `Qwen3VLMoeForConditionalGeneration` (teacher forcing, loss
on the answer tokens only) on products from the synthetic generator (seed 2000,
disjoint from the shipped sample and from the tokenizer corpus), each shown
with the benchmark's mlperf prompt and answered with compact ProductMetadata
JSON followed by <|im_end|>. The weights are written back in bfloat16 every
`--save-every` steps, so the model our engine serves is what transformers trained.

    python scripts/train_default_model.py --steps 600 --batch-size 8
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from schemas import ProductRecord
from vlm_catalog.data.synthetic.records import default_factory
from vlm_catalog.model.config import ModelConfig
from vlm_catalog.paths import DEFAULT_MODEL_DIR
from vlm_catalog.preprocess.processor import PromptProcessor
from vlm_catalog.preprocess.prompt import build_mlperf_messages

TRAIN_SEED = 2000


def answer_text(category: str, brand: str, is_secondhand: bool) -> str:
    return json.dumps({"category": category, "brand": brand, "is_secondhand": is_secondhand}, separators=(",", ":"))


class ExampleMaker:
    def __init__(self, checkpoint: Path) -> None:
        config = ModelConfig.from_pretrained(checkpoint)
        self.image_token_id = config.image_token_id
        self.processor = PromptProcessor.from_pretrained(checkpoint, image_token_id=config.image_token_id)
        self.factory = default_factory()
        self.end = self.processor.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        prompts, answers = [], []
        for index in indices:
            product = self.factory.make(TRAIN_SEED, index)
            record = ProductRecord(
                title=product.title, description=product.description,
                image=product.image_jpeg, candidate_categories=list(product.candidates),
            )
            prompts.append(self.processor.process(build_mlperf_messages(record)))
            text = answer_text(product.category, product.brand, product.is_secondhand)
            answers.append(self.processor.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.end])
        length = max(p.num_tokens + len(a) for p, a in zip(prompts, answers))
        input_ids = torch.zeros(len(indices), length, dtype=torch.long)
        labels = torch.full_like(input_ids, -100)
        attention_mask = torch.zeros_like(input_ids)
        for row, (prompt, answer) in enumerate(zip(prompts, answers)):
            sequence = prompt.token_ids + answer
            input_ids[row, : len(sequence)] = torch.tensor(sequence)
            attention_mask[row, : len(sequence)] = 1
            labels[row, prompt.num_tokens : len(sequence)] = torch.tensor(answer)
        pixel_values, grids = self.processor.load_pixels([image for p in prompts for image in p.images])
        return {
            "input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
            "pixel_values": pixel_values, "image_grid_thw": grids,
            "mm_token_type_ids": (input_ids == self.image_token_id).int(),
        }


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 1e-4 + (peak - 1e-4) * 0.5 * (1 + math.cos(math.pi * progress))


def save(model, checkpoint: Path) -> None:
    """Write the trained weights (bfloat16) into the checkpoint, keeping its other files."""
    state = {name: tensor.detach().to(torch.bfloat16) for name, tensor in model.state_dict().items()}
    with tempfile.TemporaryDirectory() as scratch:
        model.save_pretrained(scratch, state_dict=state)
        shutil.copy(Path(scratch) / "model.safetensors", checkpoint / "model.safetensors")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-index", type=int, default=0, help="first product index (to continue on fresh data)")
    args = parser.parse_args(argv)

    from transformers import Qwen3VLMoeForConditionalGeneration

    torch.manual_seed(args.seed)
    maker = ExampleMaker(args.checkpoint)
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(args.checkpoint), dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    started = time.time()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
        first = args.start_index + step * args.batch_size
        indices = list(range(first, first + args.batch_size))
        loss = model(**maker.batch(indices)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  lr {optimizer.param_groups[0]['lr']:.2e}  "
                  f"{time.time() - started:.0f}s", flush=True)
        if (step + 1) % args.save_every == 0 or step == args.steps - 1:
            save(model, args.checkpoint)
            print(f"saved {args.checkpoint} at step {step + 1}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
