#!/usr/bin/env python
"""Host time of engine decode steps: what a step costs besides the model's forward pass.

On a GPU the forward pass runs on the device, but everything else in a step
(scheduling, input building, sampling bookkeeping, grammar masks,
detokenising, building outputs) runs on the host, in series with it. This
measures that host part on the CPU engine with the shipped model:
`--batch` text requests that never stop early are prefilled, `--skip` decode
steps run (so the outputs have the length the step sees late in an answer),
then `--steps` steps are timed. The forward pass and the logits are timed
separately (each includes its own tensor work), and the rest is the host
overhead per step. `--queued N` adds N more requests (half of them
constrained) that wait behind the full batch all along, as the offline
benchmark queues its whole sample set; `--policy` picks the scheduling policy.

    python scripts/bench_step_overhead.py [--batch 256] [--skip 120] [--steps 20] [--output-kind final_only]
        [--queued 48000] [--policy shortest_prompt_first] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from vlm_catalog.engine.llm_engine import LLMEngine
from vlm_catalog.engine.sampling_params import SamplingParams
from vlm_catalog.paths import DEFAULT_MODEL_DIR


class Stopwatch:
    """Wraps a callable and adds up the seconds spent in it."""

    def __init__(self, function):
        self.function = function
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.function(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def text_request(index: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": f"Describe product {index}."}]}]


def measure(model: Path, batch: int, skip: int, steps: int, output_kind: str = "cumulative", queued: int = 0,
            policy: str = "fcfs") -> dict:
    engine = LLMEngine(model=model, max_num_seqs=batch, scheduling_policy=policy)
    params = SamplingParams(max_tokens=skip + steps + 2, ignore_eos=True, temperature=0.0, output_kind=output_kind)
    timed = [engine.add_request(text_request(i), params) for i in range(batch)]
    for i in range(batch, batch + queued):  # behind the batch all along: never admitted while it runs
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}} if i % 2 else None
        engine.add_request(text_request(i), SamplingParams(max_tokens=4, json_schema=schema))
    while any(engine.requests[i].num_computed_tokens < engine.requests[i].num_prompt_tokens for i in timed):
        engine.step()
    for _ in range(skip):
        engine.step()
    forward = Stopwatch(engine.model.forward)
    logits = Stopwatch(engine.model.compute_logits)
    engine.model.forward, engine.model.compute_logits = forward, logits  # instance attributes shadow the methods
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = time.perf_counter() - start
    running = len(engine.scheduler.running)
    engine.close()
    if running != batch:
        raise SystemExit(f"only {running} of {batch} requests were still running: the timed steps were not full")
    per_step = lambda seconds: 1e3 * seconds / steps  # noqa: E731
    return {
        "batch": batch, "output_tokens_before": skip, "steps": steps, "output_kind": output_kind,
        "queued": queued, "policy": policy,
        "ms_per_step": per_step(total), "ms_forward": per_step(forward.seconds), "ms_logits": per_step(logits.seconds),
        "ms_host": per_step(total - forward.seconds - logits.seconds),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--skip", type=int, default=120, help="decode steps run before the timed ones")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output-kind", default="cumulative", choices=["cumulative", "final_only"],
                        help="cumulative: an output per request per step (streaming); final_only: offline")
    parser.add_argument("--queued", type=int, default=0, help="requests waiting behind the batch")
    parser.add_argument("--policy", default="fcfs", choices=["fcfs", "shortest_prompt_first"])
    parser.add_argument("--json", dest="json_out", type=Path)
    args = parser.parse_args(argv)
    report = measure(args.model, args.batch, args.skip, args.steps, args.output_kind, args.queued, args.policy)
    print(f"{report['output_kind']} outputs, batch {report['batch']}, {report['queued']} queued ({report['policy']}), output tokens {report['output_tokens_before']}-"
          f"{report['output_tokens_before'] + report['steps']}: {report['ms_per_step']:.2f} ms/step = forward "
          f"{report['ms_forward']:.2f} + logits {report['ms_logits']:.2f} + host {report['ms_host']:.2f}")
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
