#!/usr/bin/env python
"""Time one sampling call of a decode step: `sample()` over a batch of logits rows.

The benchmark's requests sample with the checkpoint's generation_config.json
(temperature 0.7, top-p 0.8, top-k 20), so every decode step draws a token
for every running sequence from a 151,936-token vocabulary. This times
`vlm_catalog.engine.sampler.sample` per call at each `--batches` size for:
- `greedy` (temperature 0: an argmax, the floor);
- `generation_config` (the benchmark's settings);
- `top_p` (temperature 0.7, top-p 0.8, no top-k);
- `temperature` (0.7, no filter).

The logits are random (`--logit-scale` times a standard normal): flatter
than a trained model's, so the top-p case is at its slowest. On CUDA each
call ends in a device sync (the sampler returns host ints), so the times are
device times plus launch overhead.

    python scripts/bench_sampler.py [--device cpu|cuda] [--batches 1 64 256] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from vlm_catalog.engine.config import EngineConfigError, check_device_name
from vlm_catalog.engine.generation_config import QWEN3_VL_SAMPLING
from vlm_catalog.engine.llm_engine import check_device_present
from vlm_catalog.engine.sampler import sample
from vlm_catalog.engine.sampling_params import SamplingParams

SETTINGS = {
    "greedy": SamplingParams(),
    "generation_config": QWEN3_VL_SAMPLING.params(),
    "top_p": SamplingParams(temperature=0.7, top_p=0.8),
    "temperature": SamplingParams(temperature=0.7),
}


def time_sample(logits: torch.Tensor, params: SamplingParams, repeats: int) -> float:
    """Milliseconds per `sample()` call (after one warm-up call)."""
    rows = logits.shape[0]
    generator = torch.Generator(device=logits.device).manual_seed(0)
    sample(logits, [params] * rows, [0] * rows, generator)
    started = time.perf_counter()
    for position in range(repeats):
        sample(logits, [params] * rows, [position] * rows, generator)
    return (time.perf_counter() - started) / repeats * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--logit-scale", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    if min(args.batches) < 1 or args.vocab < 2 or args.repeats < 1:
        parser.error("--batches must be >= 1, --vocab >= 2 and --repeats >= 1")
    try:
        check_device_name(args.device, "--device")
        device = torch.device(args.device)
        check_device_present(device)  # a CPU-only torch, or no such GPU
    except EngineConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    noise = torch.Generator(device=device).manual_seed(1)
    report = {"device": str(device), "vocab": args.vocab, "logit_scale": args.logit_scale, "ms_per_call": {}}
    for batch in args.batches:
        logits = torch.randn(batch, args.vocab, device=device, generator=noise) * args.logit_scale  # [B, V]
        timings = {name: time_sample(logits, params, args.repeats) for name, params in SETTINGS.items()}
        report["ms_per_call"][str(batch)] = timings
        print(f"batch {batch:4d}: " + "  ".join(f"{name} {ms:8.2f} ms" for name, ms in timings.items()))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
