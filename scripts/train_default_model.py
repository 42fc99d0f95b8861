#!/usr/bin/env python
"""Train the default model on synthetic catalogue extraction (CPU or CUDA), resumably.

Teacher forcing with transformers' `Qwen3VLMoeForConditionalGeneration` on
synthetic products shown with the benchmark's mlperf prompt and answered with
compact ProductMetadata JSON (see `vlm_catalog/training/`). The run directory
holds the checkpoint (`state.pt`: weights, optimizer, step, RNG; saved every
`--save-every` steps and on SIGINT/SIGTERM), the servable bf16 model
(`model/`) and `log.jsonl` (loss, learning rate, held-out accuracy measured
through our engine on a generator seed never used for training).

    python scripts/train_default_model.py --run-dir scratch/training/run --steps 3000 \
        --base data/models/tiny-qwen3-vl-moe --eval-every 200
    python scripts/train_default_model.py --run-dir scratch/training/run --resume   # continue it

Ship the result by copying `<run-dir>/model/model.safetensors` into
data/models/tiny-qwen3-vl-moe once it beats the current model on held-out data.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from vlm_catalog.paths import DEFAULT_MODEL_DIR
from vlm_catalog.training.data import TrainingMix
from vlm_catalog.training.trainer import TrainConfig, Trainer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, required=True, help="checkpoint, exported model and log")
    parser.add_argument("--resume", action="store_true", help="continue the run saved in --run-dir")
    parser.add_argument("--base", type=Path, default=DEFAULT_MODEL_DIR, help="starting checkpoint (new runs)")
    parser.add_argument("--steps", type=int, help="total steps of the run (default 1000; on --resume: as saved)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--min-lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0, help="torch/python/numpy seed of the run")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=0, help="held-out evaluation every N steps (0: off)")
    parser.add_argument("--eval-seed", type=int, default=9001)
    parser.add_argument("--eval-records", type=int, default=64)
    parser.add_argument("--data-seed", type=int, default=TrainingMix.seed, help="generator seed of the training data")
    parser.add_argument("--fresh-brand-rate", type=float, default=TrainingMix.fresh_brand_rate)
    parser.add_argument("--realistic-image-rate", type=float, default=TrainingMix.realistic_image_rate)
    parser.add_argument("--photo-only-condition-rate", type=float, default=TrainingMix.photo_only_condition_rate,
                        help="share of second-hand records whose only condition cue is the photo's sticker")
    parser.add_argument("--brand-weight", type=float, default=TrainingMix.brand_weight)
    parser.add_argument("--flag-weight", type=float, default=TrainingMix.flag_weight)
    parser.add_argument("--category-weight", type=float, default=TrainingMix.category_weight,
                        help="loss weight of the category tokens that tell it from the other candidates")
    parser.add_argument("--prompt-lm-weight", type=float, default=TrainingMix.prompt_lm_weight,
                        help="weight of next-token prediction on the listing's text (0: answer only)")
    parser.add_argument("--until-step", type=int, default=None, help="stop (and save) at this step")
    parser.add_argument("--max-minutes", type=float, default=None, help="stop (and save) after this long")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.resume:
        overrides = {"steps": args.steps} if args.steps else {}
        trainer = Trainer.resume(args.run_dir, **overrides)
        print(f"resumed {args.run_dir} at step {trainer.step} of {trainer.config.steps}", flush=True)
    else:
        if (args.run_dir / "state.pt").exists():
            print(f"error: {args.run_dir} already holds a run; pass --resume or choose another --run-dir", file=sys.stderr)
            return 2
        mix = TrainingMix(
            seed=args.data_seed, fresh_brand_rate=args.fresh_brand_rate,
            realistic_image_rate=args.realistic_image_rate,
            photo_only_condition_rate=args.photo_only_condition_rate,
            brand_weight=args.brand_weight, flag_weight=args.flag_weight, category_weight=args.category_weight,
            prompt_lm_weight=args.prompt_lm_weight,
        )
        config = TrainConfig(
            base=args.base, run_dir=args.run_dir, steps=args.steps or 1000, batch_size=args.batch_size,
            lr=args.lr, min_lr=args.min_lr, warmup=args.warmup, seed=args.seed, device=args.device,
            save_every=args.save_every, log_every=args.log_every, eval_every=args.eval_every,
            eval_seed=args.eval_seed, eval_records=args.eval_records, mix=mix,
        )
        trainer = Trainer(config)
    deadline = time.time() + 60 * args.max_minutes if args.max_minutes else None
    trainer.train(until_step=args.until_step, deadline=deadline)
    print(f"saved {args.run_dir} at step {trainer.step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
