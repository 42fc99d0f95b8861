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
`--sampling benchmark` draws as the benchmark's requests do (temperature
0.7, top-p 0.8, top-k 20) instead of greedy.
`--prompt-words N` pads each prompt with N words, for the benchmark's context
lengths (a prompt with its image is 1,000-5,000 tokens): the per-step cost
of the block tables grows with them. Give the KV pool room for them
(`--kv-cache-gib`; 700 words make 2,740 tokens, and 256 such requests need 1.4 GiB).

`--gpu-paths` times the forward pass's own host work as a GPU's eager step
pays it: the model runs the GPU code paths on CPU tensors (every kernel op as
a Triton launch, as tests/kernels/test_engine_on_triton.py runs them), and each
launch is counted and skipped, so `ms_forward` is our wrappers' checks,
dispatch, allocations and launch arguments, plus the torch ops (the linears:
cuBLAS launches on a GPU, small matmuls here). Triton's own launcher is not in
it. A decode step inside a CUDA graph pays none of this; an eager step (prefill,
mixed, or a decode batch without a graph) keeps the GPU busy only while the
host launches faster than the device runs.

    python scripts/bench_step_overhead.py [--batch 256] [--skip 120] [--steps 20] [--output-kind final_only]
        [--queued 48000] [--policy shortest_prompt_first] [--prompt-words 2000] [--sampling benchmark]
        [--gpu-paths] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

import torch

from vlm_catalog.engine.generation_config import GREEDY, QWEN3_VL_SAMPLING
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


def text_request(index: int, padding_words: int = 0) -> list[dict]:
    padding = " ".join(f"part{(index + word) % 97}" for word in range(padding_words))
    return [{"role": "user", "content": [{"type": "text", "text": f"Describe product {index}. {padding}".strip()}]}]


def skip_gpu_launches() -> collections.Counter:
    """From here on the model takes the GPU code paths on CPU tensors and every Triton launch is a
    no-op, counted by kernel name in the returned Counter (`--gpu-paths`). Call it before any
    kernel module is compiled: the interpreter is chosen when the kernels are defined."""
    if any(name.startswith("kernels.jit") for name in sys.modules):
        raise RuntimeError("skip_gpu_launches() must run before the Triton kernels are imported")
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["VLM_CATALOG_KERNELS"] = "auto"
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError as error:
        raise SystemExit(f"--gpu-paths needs triton (the dev extra): {error}") from None

    import kernels.dispatch

    kernels.dispatch.AUTO_DEVICE_TYPES = ("cuda", "cpu")  # `auto` makes a GPU's choices for CPU tensors
    torch.set_num_threads(1)  # the small matmuls left (cuBLAS launches on a GPU) without thread hand-offs
    launches: collections.Counter[str] = collections.Counter()

    def counted(function, *args, **kwargs) -> None:
        launches[function.fn.__name__] += 1

    InterpretedFunction.run = counted
    # no kernel runs, so the engine's start-up check of the kernels that finish in their last
    # program would compare empty outputs and withdraw their counters: the step would then launch
    # what a GPU that passed it does not (kernels/arrival_counters.py)
    from kernels.arrival_counters import trust_without_checking

    trust_without_checking(torch.device("cpu"))
    return launches


def measure(model: Path, batch: int, skip: int, steps: int, output_kind: str = "cumulative", queued: int = 0,
            policy: str = "fcfs", prompt_words: int = 0, kv_cache_gib: float | None = None,
            sampling: str = "greedy", launches: collections.Counter | None = None) -> dict:
    """`launches`: skip_gpu_launches()'s counter (the forward on the GPU code paths, launches
    skipped): the report adds the launches and the forward's host time per step and per layer."""
    kv_bytes = int(kv_cache_gib * 2**30) if kv_cache_gib else None
    engine = LLMEngine(model=model, max_num_seqs=batch, scheduling_policy=policy, kv_cache_memory_bytes=kv_bytes)
    prompts = [engine.processor.process(text_request(i, prompt_words)) for i in range(batch)]
    prompt_tokens = sum(prompt.num_tokens for prompt in prompts) / batch
    # the first requests decode while the last prefill: none may finish before the timed steps
    prefill_steps = -(-sum(prompt.num_tokens for prompt in prompts) // engine.config.max_num_batched_tokens)
    draw = QWEN3_VL_SAMPLING if sampling == "benchmark" else GREEDY
    params = draw.params(max_tokens=skip + steps + 2 + prefill_steps, ignore_eos=True, output_kind=output_kind)
    timed = [engine.add_request(prompt, params) for prompt in prompts]
    for i in range(batch, batch + queued):  # behind the batch all along: never admitted while it runs
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}} if i % 2 else None
        # longer than the timed prompts, so shortest-prompt-first keeps them behind too
        engine.add_request(text_request(i, prompt_words + 8), SamplingParams(max_tokens=4, json_schema=schema))
    while any(engine.requests[i].num_computed_tokens < engine.requests[i].num_prompt_tokens for i in timed):
        engine.step()
    for _ in range(skip):
        engine.step()
    forward = Stopwatch(engine.model.forward)
    logits = Stopwatch(engine.model.compute_logits)
    engine.model.forward, engine.model.compute_logits = forward, logits  # instance attributes shadow the methods
    layers = engine.model.config.text.num_layers
    if launches is not None:
        launches.clear()
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
        "queued": queued, "policy": policy, "prompt_tokens": round(prompt_tokens), "sampling": sampling,
        "ms_per_step": per_step(total), "ms_forward": per_step(forward.seconds), "ms_logits": per_step(logits.seconds),
        "ms_host": per_step(total - forward.seconds - logits.seconds),
        **({} if launches is None else {
            "gpu_paths": True, "layers": layers, "ms_forward_per_layer": per_step(forward.seconds) / layers,
            "triton_launches_per_step": sum(launches.values()) / steps,
            "launches_per_step": {name: count / steps for name, count in sorted(launches.items())},
        }),
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
    parser.add_argument("--prompt-words", type=int, default=0, help="padding words per prompt (longer contexts)")
    parser.add_argument("--kv-cache-gib", type=float, help="KV pool size (the shipped model takes 2 KiB per token; "
                        "the CPU default of 0.25 GiB holds 256 requests of about 500 tokens)")
    parser.add_argument("--sampling", default="greedy", choices=["greedy", "benchmark"],
                        help="benchmark: temperature 0.7, top-p 0.8, top-k 20 (Qwen3-VL's generation_config)")
    parser.add_argument("--gpu-paths", action="store_true",
                        help="the forward on the GPU code paths with every Triton launch skipped: its host work")
    parser.add_argument("--json", dest="json_out", type=Path)
    args = parser.parse_args(argv)
    launches = skip_gpu_launches() if args.gpu_paths else None
    report = measure(args.model, args.batch, args.skip, args.steps, args.output_kind, args.queued, args.policy,
                     args.prompt_words, args.kv_cache_gib, args.sampling, launches)
    print(f"{report['sampling']} sampling, {report['output_kind']} outputs, batch {report['batch']}, {report['prompt_tokens']}-token prompts, "
          f"{report['queued']} queued ({report['policy']}), output tokens {report['output_tokens_before']}-"
          f"{report['output_tokens_before'] + report['steps']}: {report['ms_per_step']:.2f} ms/step = forward "
          f"{report['ms_forward']:.2f} + logits {report['ms_logits']:.2f} + host {report['ms_host']:.2f}")
    if launches is not None:
        print(f"GPU code paths, launches skipped: the forward's host work is {report['ms_forward_per_layer']:.3f} ms "
              f"per layer ({report['layers']} layers), {report['triton_launches_per_step']:.0f} Triton launches "
              f"per step")
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
