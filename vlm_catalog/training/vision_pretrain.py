"""Pretrain the vision tower on what the synthetic photos show, then put it into a checkpoint.

The language-model loss alone does not teach the default model's tower to
see the condition sticker (`vision_probe.py`): the language model never looks
at the photo, so no gradient asks the tower for it. This stage supervises the
tower directly. A freshly initialised tower (the trained one has settled in
a state that learns far more slowly) gets a temporary linear head on its pooled
output that predicts, per photo, whether it carries a condition sticker and
which glyph the product shows. Then `graft` writes a checkpoint whose vision
weights are the pretrained tower's and whose other weights are unchanged; the
head is thrown away. Training the whole model from there (scripts/
train_default_model.py --base <grafted>) lets the language model learn to read it.

    python -m vlm_catalog.training.vision_pretrain --base data/models/tiny-qwen3-vl-moe \
        --out scratch/training/grafted --steps 1000
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from vlm_catalog.data.synthetic.records import RecordFactory, default_factory
from vlm_catalog.data.synthetic.signature import GLYPHS
from vlm_catalog.evaluate.metrics import binary_f1
from vlm_catalog.folders import check_folder_can_be_made
from vlm_catalog.preprocess.image import ImageProcessor
from vlm_catalog.training.checkpoint import checkpoint_problem, export_model
from vlm_catalog.training.vision_probe import load_model

INIT_STD = 0.02


def reinitialise(visual: torch.nn.Module, generator: torch.Generator) -> None:
    """Fresh random weights for every layer of the tower."""
    for module in visual.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv3d)):
            with torch.no_grad():
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * INIT_STD)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, torch.nn.LayerNorm):
            torch.nn.init.ones_(module.weight)
            torch.nn.init.zeros_(module.bias)
        elif isinstance(module, torch.nn.Embedding):
            with torch.no_grad():
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * INIT_STD)


def pooled(visual: torch.nn.Module, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
    """(images, 2 * hidden): mean and max over each photo's merged tokens, centred and layer-normed."""
    tokens = visual(pixel_values, grid_thw=torch.tensor(grids)).pooler_output  # (all merged tokens, hidden)
    merge = visual.spatial_merge_size**2
    rows = []
    for chunk in torch.split(tokens, [t * h * w // merge for t, h, w in grids]):
        chunk = chunk - chunk.mean(-1, keepdim=True)  # (tokens, hidden)
        rows.append(torch.cat([chunk.mean(0), chunk.max(0).values]))
    features = torch.stack(rows)  # (images, 2 * hidden)
    return torch.nn.functional.layer_norm(features, features.shape[-1:])


class PhotoData:
    """Photos of generator `seed` with their labels: sticker (second-hand, photo-only cue) and glyph."""

    def __init__(self, checkpoint: Path, seed: int, factory: RecordFactory | None = None) -> None:
        self.seed = seed
        self.factory = factory or default_factory()
        self.images = ImageProcessor.from_pretrained(checkpoint)

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, list, torch.Tensor, torch.Tensor]:
        records = [self.factory.make(self.seed, index, photo_only_condition=True) for index in indices]
        images = self.images.process_many([record.image_jpeg for record in records])
        # photo-only: every second-hand item's photo carries the sticker
        stickers = [float(record.is_secondhand) for record in records]
        glyphs = [GLYPHS.index(self.factory.signature(record.category).glyph) for record in records]
        return (torch.cat([image.pixel_values for image in images]), [tuple(image.grid_thw) for image in images],
                torch.tensor(stickers), torch.tensor(glyphs))


def photo_loss(visual, head, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, logits): sticker BCE + glyph cross-entropy of the head on the pooled tower output."""
    pixels, grids, stickers, glyphs = batch
    logits = head(pooled(visual, pixels, grids))  # (images, 1 + len(GLYPHS))
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits[:, 0], stickers)
    return loss + torch.nn.functional.cross_entropy(logits[:, 1:], glyphs), logits


def accuracy(visual, head, batch) -> tuple[float, float]:
    """(sticker F1, glyph accuracy) of the head on `batch`."""
    with torch.no_grad():
        _, logits = photo_loss(visual, head, batch)
    _, _, stickers, glyphs = batch
    f1 = binary_f1(zip((logits[:, 0] > 0).tolist(), (stickers == 1).tolist()))
    return f1, float((logits[:, 1:].argmax(-1) == glyphs).float().mean())


def pretrain_vision(model, data: PhotoData, steps: int, batch_size: int = 16, lr: float = 3e-3,
                    seed: int = 0, heldout: PhotoData | None = None, log_every: int = 100) -> list[dict]:
    """Reinitialise `model`'s tower and train it with a temporary head; returns the log."""
    generator = torch.Generator().manual_seed(seed)
    visual = model.model.visual.train()
    reinitialise(visual, generator)
    width = 2 * visual.merger.linear_fc2.out_features
    head = torch.nn.Linear(width, 1 + len(GLYPHS))
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * INIT_STD)
        head.bias.zero_()
    optimizer = torch.optim.AdamW(list(visual.parameters()) + list(head.parameters()), lr=lr)
    check = heldout.batch(list(range(200))) if heldout else None
    log, start = [], time.time()
    for step in range(steps):
        loss, _ = photo_loss(visual, head, data.batch(list(range(step * batch_size, (step + 1) * batch_size))))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % log_every == 0 or step + 1 == steps:
            entry = {"step": step + 1, "loss": float(loss.detach()), "seconds": round(time.time() - start, 1)}
            if check is not None:
                entry["sticker_f1"], entry["glyph_accuracy"] = accuracy(visual, head, check)
            log.append(entry)
            print(entry, flush=True)
    visual.eval()
    return log


def _argument_problem(args: argparse.Namespace) -> str | None:
    """What makes the run fail or mislead, found before the training (None: nothing)."""
    if args.out.exists():
        return f"{args.out} exists; choose another --out"
    if args.steps < 1 or args.batch_size < 1:  # --steps 0 exported a random tower as "pretrained"
        return f"--steps and --batch-size must be at least 1, got {args.steps} and {args.batch_size}"
    if not 0 < args.lr < math.inf:
        return f"--lr must be a finite number above 0, got {args.lr}"
    if args.data_seed == args.eval_seed:
        return f"--data-seed and --eval-seed must differ (both {args.eval_seed}): the log would score training photos"
    problem = checkpoint_problem(args.base, "--base")
    if problem:
        return problem
    if args.out.parent.exists() and not args.out.parent.is_dir():
        return f"--out {args.out}: {args.out.parent} is a file, not a folder"
    try:  # the export comes after the training: its folder must be writable now (it is made then)
        check_folder_can_be_made(args.out.parent, f".{args.out.name}.write-check")
    except OSError as exc:
        return f"--out {args.out} cannot be written: {exc.strerror or exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True, help="checkpoint whose tower is replaced")
    parser.add_argument("--out", type=Path, required=True, help="the grafted checkpoint")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed")
    parser.add_argument("--data-seed", type=int, default=3200, help="generator seed of the photos")
    parser.add_argument("--eval-seed", type=int, default=9001, help="held-out photos for the log")
    args = parser.parse_args(argv)
    problem = _argument_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    model = load_model(args.base)
    pretrain_vision(model, PhotoData(args.base, args.data_seed), args.steps, args.batch_size, args.lr,
                    args.seed, PhotoData(args.base, args.eval_seed))
    export_model(model, args.base, args.out)
    print(f"wrote {args.out}: the vision tower of {args.base} replaced by the pretrained one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
