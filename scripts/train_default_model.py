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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vlm_catalog.engine.config import EngineConfigError
from vlm_catalog.error_text import one_line
from vlm_catalog.folders import check_folder_can_be_made, make_writable_folder
from vlm_catalog.model.config import ModelConfigError
from vlm_catalog.model.loader import CheckpointError
from vlm_catalog.paths import DEFAULT_MODEL_DIR
from vlm_catalog.training.checkpoint import STATE_FILE, checkpoint_problem, load_state
from vlm_catalog.training.data import TrainingMix
from vlm_catalog.training.trainer import TrainConfig, Trainer, TrainingDiverged

# flags that set the run (saved with it): the TrainConfig field, or the TrainingMix field under "mix."
RUN_SETTINGS = {
    "base": "base", "batch_size": "batch_size", "lr": "lr", "min_lr": "min_lr", "warmup": "warmup",
    "seed": "seed", "device": "device", "save_every": "save_every", "log_every": "log_every",
    "eval_every": "eval_every", "eval_seed": "eval_seed", "eval_records": "eval_records",
    "data_seed": "mix.seed", "fresh_brand_rate": "mix.fresh_brand_rate",
    "realistic_image_rate": "mix.realistic_image_rate", "photo_only_condition_rate": "mix.photo_only_condition_rate",
    "brand_weight": "mix.brand_weight", "flag_weight": "mix.flag_weight", "category_weight": "mix.category_weight",
    "prompt_lm_weight": "mix.prompt_lm_weight",
}
DEFAULT_STEPS = 1000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options; a run setting not given is None here (its default comes from TrainConfig/TrainingMix),
    so that `--resume` can tell a setting given again from one left out."""
    config, mix = TrainConfig(base=DEFAULT_MODEL_DIR, run_dir=Path(".")), TrainingMix()

    def default(field: str) -> str:
        return f"(default {getattr(mix, field[4:]) if field.startswith('mix.') else getattr(config, field)})"

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, required=True, help="checkpoint, exported model and log")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run saved in --run-dir, with its saved settings")
    parser.add_argument("--base", type=Path, help=f"starting checkpoint {default('base')}")
    parser.add_argument("--steps", type=int,
                        help=f"total steps of the run (default {DEFAULT_STEPS}; on --resume: as saved)")
    parser.add_argument("--batch-size", type=int, help=default("batch_size"))
    parser.add_argument("--lr", type=float, help=default("lr"))
    parser.add_argument("--min-lr", type=float, help=default("min_lr"))
    parser.add_argument("--warmup", type=int, help=default("warmup"))
    parser.add_argument("--seed", type=int, help=f"torch/python/numpy seed of the run {default('seed')}")
    parser.add_argument("--device", help=f"cpu, cuda, cuda:1, ... {default('device')}")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--save-every", type=int, help=default("save_every"))
    parser.add_argument("--log-every", type=int, help=default("log_every"))
    parser.add_argument("--eval-every", type=int, help="held-out evaluation every N steps (0: off, the default)")
    parser.add_argument("--eval-seed", type=int, help=default("eval_seed"))
    parser.add_argument("--eval-records", type=int, help=default("eval_records"))
    parser.add_argument("--data-seed", type=int, help=f"generator seed of the training data {default('mix.seed')}")
    parser.add_argument("--fresh-brand-rate", type=float, help=default("mix.fresh_brand_rate"))
    parser.add_argument("--realistic-image-rate", type=float, help=default("mix.realistic_image_rate"))
    parser.add_argument("--photo-only-condition-rate", type=float,
                        help="share of second-hand records whose only condition cue is the photo's sticker "
                             + default("mix.photo_only_condition_rate"))
    parser.add_argument("--brand-weight", type=float, help=default("mix.brand_weight"))
    parser.add_argument("--flag-weight", type=float, help=default("mix.flag_weight"))
    parser.add_argument("--category-weight", type=float,
                        help="loss weight of the category tokens that tell it from the other candidates "
                             + default("mix.category_weight"))
    parser.add_argument("--prompt-lm-weight", type=float,
                        help="weight of next-token prediction on the listing's text (0: answer only) "
                             + default("mix.prompt_lm_weight"))
    parser.add_argument("--until-step", type=int, default=None, help="stop (and save) at this step")
    parser.add_argument("--max-minutes", type=float, default=None, help="stop (and save) after this long")
    args = parser.parse_args(argv)
    for name, least in (("steps", 1), ("until_step", 1), ("threads", 1)):
        value = getattr(args, name)
        if value is not None and value < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
    if args.max_minutes is not None and not args.max_minutes > 0:  # NaN fails too
        parser.error(f"--max-minutes must be more than 0, got {args.max_minutes}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        trainer = _resumed(args) if args.resume else _new_run(args)
    except RunDirError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    deadline = time.time() + 60 * args.max_minutes if args.max_minutes is not None else None
    try:
        trainer.train(until_step=args.until_step, deadline=deadline)
    except TrainingDiverged as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"saved {args.run_dir} at step {trainer.step}", flush=True)
    return 0


class RunDirError(Exception):
    """A run that cannot start or resume as asked; the message says why."""


def _given_settings(args: argparse.Namespace) -> dict[str, object]:
    """The run settings given on the command line, by option name (`RUN_SETTINGS` maps them to the config)."""
    return {dest: getattr(args, dest) for dest in RUN_SETTINGS if getattr(args, dest) is not None}


def _saved_setting(config: dict[str, Any], field: str) -> object:
    """A setting of a saved run's config, by its `RUN_SETTINGS` name ("mix.x": the mix's x)."""
    return config["mix"][field[4:]] if field.startswith("mix.") else config[field]


def _resumed(args: argparse.Namespace) -> Trainer:
    if not (args.run_dir / STATE_FILE).is_file():
        raise RunDirError(f"--resume: {args.run_dir / STATE_FILE} does not exist, so there is no run to continue")
    saved = load_state(args.run_dir)
    changed = []
    for dest, given in _given_settings(args).items():
        saved_value = _saved_setting(saved["config"], RUN_SETTINGS[dest])
        if dest == "base" and _same_base(given, saved_value):
            continue
        if str(given) != str(saved_value):
            changed.append(f"--{dest.replace('_', '-')} {given} (saved: {saved_value})")
    if changed:
        raise RunDirError(
            "a resumed run keeps the settings it started with; only --steps, --until-step, --max-minutes "
            f"and --threads apply on --resume. These differ: {'; '.join(changed)}"
        )
    if args.steps is not None and args.steps < saved["step"]:
        raise RunDirError(f"--steps {args.steps} is below the step the run is at ({saved['step']})")
    overrides: dict[str, Any] = {"steps": args.steps} if args.steps is not None else {}
    base = Path(args.base if args.base is not None else saved["config"]["base"])
    if not (base / "config.json").is_file():  # a run of an earlier version saved --base as typed, maybe relative
        raise RunDirError(f"the run's base checkpoint {base} is not found from here; pass --base with its path")
    overrides["base"] = base.resolve()
    trainer = _trainer(lambda: Trainer.resume(args.run_dir, saved, **overrides), base)  # state.pt read once
    print(f"resumed {args.run_dir} at step {trainer.step} of {trainer.config.steps}", flush=True)
    return trainer


def _same_base(given: Path, saved: str) -> bool:
    """`--base` on resume names the saved base: the same path resolved; or, where the saved path leads
    to no checkpoint from here (saved relative by an earlier version, or the base moved since), any
    checkpoint, as the weights come from state.pt (the config and tokenizer must be the base's)."""
    if Path(saved).is_absolute() and (Path(saved) / "config.json").is_file():
        return Path(given).resolve() == Path(saved)
    # saved relative (an earlier version), or moved since: any checkpoint serves
    return str(given) == saved or (Path(given) / "config.json").is_file()


def _new_run(args: argparse.Namespace) -> Trainer:
    run_dir = args.run_dir
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"--run-dir {run_dir} is a file; a run needs a folder")
    if (run_dir / STATE_FILE).exists():
        raise RunDirError(f"{run_dir} already holds a run; pass --resume or choose another --run-dir")
    if run_dir.is_dir() and any(run_dir.iterdir()):  # another run's log or model, which a new run would mix in
        raise RunDirError(f"{run_dir} is not empty and holds no {STATE_FILE} to resume; choose a new or empty --run-dir")
    given = {RUN_SETTINGS[dest]: value for dest, value in _given_settings(args).items()}
    settings = {field: value for field, value in given.items() if not field.startswith("mix.")}
    settings.setdefault("base", DEFAULT_MODEL_DIR)
    problem = checkpoint_problem(Path(settings["base"]), "--base")
    if problem:
        raise RunDirError(problem)
    settings["base"] = Path(settings["base"]).resolve()  # saved so: a resume from another folder finds it
    try:
        mix = TrainingMix(**{field[4:]: value for field, value in given.items() if field.startswith("mix.")})
        config = TrainConfig(run_dir=run_dir, steps=args.steps if args.steps is not None else DEFAULT_STEPS,
                             mix=mix, **settings)
    except ValueError as exc:  # a setting out of range
        raise RunDirError(str(exc)) from None
    # checked before the model loads (before, a run dir under a file failed at the first log line, after
    # training), made once it has loaded: a start refused meanwhile (no such device, a base that does not
    # load) leaves no empty run folder behind
    _writable_run_dir(check_folder_can_be_made, run_dir)
    trainer = _trainer(lambda: Trainer(config), config.base)
    _writable_run_dir(make_writable_folder, run_dir)
    return trainer


def _writable_run_dir(check: Callable[[Path], None], run_dir: Path) -> None:
    """`check(run_dir)` (`vlm_catalog.folders`), its OSError a `RunDirError`."""
    try:
        check(run_dir)
    except OSError as exc:
        raise RunDirError(f"--run-dir {run_dir} cannot be written: {exc.strerror or exc}") from None


def _trainer(make: Callable[[], Trainer], base: Path) -> Trainer:
    try:
        return make()
    except EngineConfigError as exc:  # a device this machine lacks (a CPU-only torch, no such GPU)
        raise RunDirError(str(exc)) from None
    except (ModelConfigError, CheckpointError) as exc:  # another model's config.json, damaged weights
        raise RunDirError(f"the base checkpoint {base} does not load: {one_line(exc)}") from None


if __name__ == "__main__":
    sys.exit(main())
