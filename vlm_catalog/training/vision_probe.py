"""Does a model use its photos? Three measures of the vision path of a checkpoint.

The synthetic photos carry two facts no text gives in some listings: a
condition sticker (second-hand items whose only cue is the photo) and the
leaf's glyph. This module measures, on records of a generator seed:

- `image_effect`: how much the answer's is_secondhand probability moves when
  the photo of a photo-only second-hand item is blanked (pixel values 0). A
  model that reads the sticker moves it; one that ignores the image does not.
- `probe_f1`: a logistic probe for "has a sticker", trained on pooled
  features of 2/3 of the images and scored (F1) on the rest, at each stage of
  the vision tower: the raw pixel patches, the patch embedding, every block,
  and the merger (what the language model receives). Where the F1 drops, the
  tower loses the sticker.
- `token_cosine`: the mean pairwise cosine similarity of the merged image
  tokens across images; near 1, every image looks alike to the language model.

    python -m vlm_catalog.training.vision_probe --model data/models/tiny-qwen3-vl-moe
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from vlm_catalog.argument_types import at_least, positive_int
from vlm_catalog.evaluate.metrics import binary_f1
from vlm_catalog.report_file import refuse_report_path, report_written
from vlm_catalog.training.checkpoint import checkpoint_problem
from vlm_catalog.training.data import ExampleBuilder, TrainingMix

PROBE_STEPS = 300
PROBE_L2 = 1e-2
FLAG_MARK = 7.0  # the loss weight that marks the is_secondhand value tokens (no other token has it)


@dataclass
class VisionReport:
    records: int
    secondhand: int  # of them, each with the photo as its only condition cue
    mean_p_true_real: float  # mean p(is_secondhand = true) of the photo-only second-hand items
    mean_p_true_blank: float  # the same with their photos blanked
    probe_f1: dict[str, float]  # stage -> held-out F1 of the sticker probe
    token_cosine: float


def load_model(model_dir: Path):
    from transformers import Qwen3VLMoeForConditionalGeneration

    return Qwen3VLMoeForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def photo_only_builder(model_dir: Path, seed: int) -> ExampleBuilder:
    """Examples of generator `seed` whose second-hand items have only the photo's sticker."""
    mix = TrainingMix(seed=seed, fresh_brand_rate=0.0, realistic_image_rate=0.0, photo_only_condition_rate=1.0,
                      flag_weight=FLAG_MARK)
    return ExampleBuilder(model_dir, mix)


@torch.no_grad()
def image_effect(model, builder: ExampleBuilder, indices: list[int]) -> tuple[float, float, int]:
    """(mean p(true) with the photo, with it blanked, items) over the second-hand records."""
    true_id = builder.tokenizer.encode("true", add_special_tokens=False)[0]
    real, blank = [], []
    for index in indices:
        record = builder.mix.record(builder.factory, index)
        if not record.is_secondhand:
            continue
        batch = builder.batch([index])
        position = int(batch.positions[batch.weights.tolist().index(FLAG_MARK)])  # predicts the flag's value
        for pixels, into in ((batch.inputs["pixel_values"], real), (torch.zeros_like(batch.inputs["pixel_values"]), blank)):
            hidden = model.model(**{**batch.inputs, "pixel_values": pixels}).last_hidden_state  # (1, L, hidden)
            into.append(float(model.lm_head(hidden[0, position]).float().softmax(-1)[true_id]))
    count = len(real)
    return (sum(real) / count if count else float("nan"), sum(blank) / count if count else float("nan"), count)


@torch.no_grad()
def stage_features(model, builder: ExampleBuilder, indices: list[int]) -> tuple[dict[str, torch.Tensor], torch.Tensor, float]:
    """Pooled features per vision stage, (N, 3 * width) each; sticker labels (N,); token cosine."""
    visual = model.model.visual
    captured: dict[str, torch.Tensor] = {}
    stages = [("patch_embed", visual.patch_embed)] + [(f"block{i}", b) for i, b in enumerate(visual.blocks)]
    stages.append(("merger", visual.merger))
    hooks = [module.register_forward_hook(
        lambda _m, _a, output, name=name: captured.__setitem__(name, output[0] if isinstance(output, tuple) else output))
        for name, module in stages]
    pooled: dict[str, list[torch.Tensor]] = {name: [] for name in ["raw"] + [n for n, _ in stages]}
    labels, merged = [], []
    try:
        for index in indices:
            record = builder.mix.record(builder.factory, index)
            image = builder.processor.image_processor.process_many([record.image_jpeg], num_workers=1)[0]
            visual(image.pixel_values, grid_thw=torch.tensor([image.grid_thw]))
            captured["raw"] = image.pixel_values
            for name in pooled:
                tokens = captured[name]  # (tokens, width)
                pooled[name].append(torch.cat([tokens.mean(0), tokens.max(0).values, tokens.std(0)]))
            merged.append(torch.nn.functional.normalize(captured["merger"], dim=-1))
            labels.append(float(record.is_secondhand))
    finally:
        for hook in hooks:
            hook.remove()
    tokens = torch.cat(merged)  # (all merged tokens, hidden)
    cosine = float((tokens @ tokens.T).mean())
    return {name: torch.stack(rows) for name, rows in pooled.items()}, torch.tensor(labels), cosine


def probe_f1(features: torch.Tensor, labels: torch.Tensor, train: int) -> float:
    """Held-out F1 of an L2-regularised logistic probe trained on the first `train` rows."""
    mean, std = features[:train].mean(0), features[:train].std(0) + 1e-6
    x = (features - mean) / std  # (N, F), standardised on the training rows
    weights = torch.zeros(x.shape[1], requires_grad=True)
    bias = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.Adam([weights, bias], lr=0.02)
    with torch.enable_grad():
        for _ in range(PROBE_STEPS):
            optimizer.zero_grad()
            logits = x[:train] @ weights + bias
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels[:train])
            (loss + PROBE_L2 * weights.pow(2).sum()).backward()
            optimizer.step()
    predicted = (x[train:] @ weights + bias).detach() > 0
    return binary_f1(zip(predicted.tolist(), (labels[train:] == 1).tolist()))


def measure(model_dir: Path, seed: int = 77, records: int = 300, effect_records: int = 60) -> VisionReport:
    model = load_model(model_dir)
    builder = photo_only_builder(model_dir, seed)
    real, blank, secondhand = image_effect(model, builder, list(range(effect_records)))
    features, labels, cosine = stage_features(model, builder, list(range(records)))
    train = records * 2 // 3
    return VisionReport(
        records=records, secondhand=secondhand, mean_p_true_real=real, mean_p_true_blank=blank,
        probe_f1={name: probe_f1(rows, labels, train) for name, rows in features.items()},
        token_cosine=cosine,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=77, help="generator seed of the probe's records")
    parser.add_argument("--records", type=at_least(3), default=300,
                        help="images for the probes (at least 3: each probe trains on 2/3 of them, scores the rest)")
    parser.add_argument("--effect-records", type=positive_int, default=60, help="records for the blanking test")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if refuse_report_path(args.json):  # before the probes, not after them
        return 2
    problem = checkpoint_problem(args.model, "--model")
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    report = measure(args.model, args.seed, args.records, args.effect_records)
    print(f"photo-only second-hand items: {report.secondhand}; mean p(true) with the photo "
          f"{report.mean_p_true_real:.3f}, blanked {report.mean_p_true_blank:.3f}")
    print("sticker probe F1 by stage: " + ", ".join(f"{k} {v:.2f}" for k, v in report.probe_f1.items()))
    print(f"mean pairwise cosine of merged image tokens: {report.token_cosine:.3f}")
    return 1 if args.json and not report_written(args.json, json.dumps(asdict(report), indent=2) + "\n") else 0


if __name__ == "__main__":
    sys.exit(main())
