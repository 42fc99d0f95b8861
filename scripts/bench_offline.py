#!/usr/bin/env python
"""Offline throughput on CPU: our engine against transformers, and what each engine feature buys.

One run, one synthetic catalogue (default 256 records, small images), the
mlperf prompt, the shipped default model, float32. Every run starts from the
records (prompt building, tokenisation and image decoding are timed on both
sides); model loading is not timed. Both sides are warmed up first on a few
records (first-call costs of torch, thread pools and the grammar compiler stay
out of the numbers); every timed run of ours starts from a fresh engine, with
an empty prefix cache.

1. transformers `generate`, one request at a time, `--max-tokens` greedy tokens
   (no stopping), and 2. the same in left-padded batches of `--hf-batch-size`,
   against 3. our engine on the same requests: samples/s, and whether the greedy
   tokens are identical (record by record).
4. Constrained decoding cost: our engine with the per-record ProductMetadata
   schema (jump-forward off) against the same engine unconstrained, each
   record generating exactly as many tokens as its constrained answer had.
5. Jump-forward: model steps per record with it on and off (same text).
6. Prefix caching on and off: prompt tokens computed and samples/s.

    python scripts/bench_offline.py [--records 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from schemas import ProductMetadata
from vlm_catalog import LLM, SamplingParams
from vlm_catalog.argument_types import positive_int
from vlm_catalog.bench.baselines import TransformersPipeline
from vlm_catalog.data.format import CatalogueError
from vlm_catalog.data.loader import load_catalogue
from vlm_catalog.data.synthetic.generator import make_catalog
from vlm_catalog.paths import DEFAULT_MODEL_DIR
from vlm_catalog.preprocess.prompt import build_messages
from vlm_catalog.structured import catalogue_schema

WARM_UP_RECORDS = 4


@dataclass
class Run:
    name: str
    seconds: float
    records: int
    generated_tokens: int
    model_steps: int | None = None
    prompt_tokens_computed: int | None = None
    note: str = ""

    @property
    def samples_per_second(self) -> float:
        return self.records / self.seconds

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds


# --------------------------------------------------------------------------- our engine
def our_run(name, model_dir, records, conversations, params, note="", **engine_options):
    llm = LLM(model_dir, **engine_options)
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    seconds = time.perf_counter() - start
    stats = llm.engine.stats
    run = Run(name, seconds, len(records), sum(len(o.token_ids) for o in outputs),
              model_steps=stats.num_sampled_tokens, prompt_tokens_computed=stats.num_prompt_tokens_computed, note=note)
    llm.engine.close()
    return run, outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--records", type=positive_int, default=256)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--dataset", type=Path, help="use this catalogue instead of generating one")
    parser.add_argument("--max-tokens", type=positive_int, default=32,
                        help="greedy tokens per record in the transformers comparison")
    parser.add_argument("--hf-batch-size", type=positive_int, default=16)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", dest="json_out", type=Path)
    args = parser.parse_args(argv)
    torch.manual_seed(0)

    try:
        with tempfile.TemporaryDirectory() as scratch:
            source = args.dataset or make_catalog(Path(scratch) / "catalogue", args.records, args.seed)
            records = list(load_catalogue(source))[: args.records]
    except CatalogueError as exc:  # no such --dataset, or not a catalogue
        print(f"error: {exc}", file=sys.stderr)
        return 2
    conversations = [build_messages(record) for record in records]
    runs: list[Run] = []
    checks: dict[str, object] = {"records": len(records), "threads": torch.get_num_threads()}
    fixed = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    # warm-up, untimed: our engine (constrained, so the grammar compiler warms too) and transformers
    warm_records = records[:WARM_UP_RECORDS]
    our_run("warm-up", args.model, warm_records, conversations[:WARM_UP_RECORDS],
            [SamplingParams(max_tokens=args.max_tokens, json_schema=catalogue_schema(r.candidate_categories))
             for r in warm_records])
    hf = None if args.skip_transformers else TransformersPipeline(args.model)
    if hf is not None:
        hf.generate(conversations[:1], args.max_tokens)

    # 1-3: transformers against our engine, same greedy tokens
    ours, our_outputs = our_run("ours, unconstrained greedy", args.model, records, conversations, fixed,
                                note=f"{args.max_tokens} tokens/record")
    if hf is not None:
        start = time.perf_counter()
        single = [hf.generate([messages], args.max_tokens)[0] for messages in conversations]
        runs.append(Run("transformers generate, 1 at a time", time.perf_counter() - start, len(records),
                        len(records) * args.max_tokens, note=f"{args.max_tokens} tokens/record"))
        start = time.perf_counter()
        batched = []
        for first in range(0, len(conversations), args.hf_batch_size):
            batched += hf.generate(conversations[first : first + args.hf_batch_size], args.max_tokens)
        runs.append(Run(f"transformers generate, padded batches of {args.hf_batch_size}", time.perf_counter() - start,
                        len(records), len(records) * args.max_tokens, note=f"{args.max_tokens} tokens/record"))
        checks["greedy_tokens_equal_to_transformers_single"] = sum(o.token_ids == t for o, t in zip(our_outputs, single))
        checks["greedy_tokens_equal_to_transformers_batched"] = sum(o.token_ids == t for o, t in zip(our_outputs, batched))
        checks["speedup_vs_transformers_single"] = runs[0].seconds / ours.seconds
        checks["speedup_vs_transformers_batched"] = runs[1].seconds / ours.seconds
    runs.append(ours)

    # 4: constrained decoding cost (jump-forward off), against unconstrained with the same token counts
    schema_params = [SamplingParams(max_tokens=150, json_schema=catalogue_schema(r.candidate_categories)) for r in records]
    constrained, constrained_outputs = our_run("ours, constrained, jump-forward off", args.model, records,
                                               conversations, schema_params, enable_jump_forward=False)
    same_lengths = [SamplingParams(max_tokens=max(1, len(o.token_ids)), ignore_eos=True) for o in constrained_outputs]
    unconstrained, _ = our_run("ours, unconstrained, same token counts", args.model, records, conversations, same_lengths)
    checks["constrained_decoding_cost"] = constrained.seconds / unconstrained.seconds - 1
    checks["answers_that_parse"] = sum(_parses(o.text) for o in constrained_outputs)
    checks["answers_finished_by_length"] = sum(o.finish_reason == "length" for o in constrained_outputs)

    # 5: jump-forward on (same answers, fewer model steps)
    jump, jump_outputs = our_run("ours, constrained, jump-forward on", args.model, records, conversations, schema_params)
    checks["jump_forward_same_text"] = sum(a.text == b.text for a, b in zip(jump_outputs, constrained_outputs))
    checks["model_steps_per_record_jump_forward_off"] = constrained.model_steps / len(records)
    checks["model_steps_per_record_jump_forward_on"] = jump.model_steps / len(records)
    checks["jump_forward_step_reduction"] = 1 - jump.model_steps / constrained.model_steps

    # 6: prefix caching off (the benchmark's rules forbid it in submissions)
    no_cache, _ = our_run("ours, constrained, jump-forward on, prefix cache off", args.model, records,
                          conversations, schema_params, enable_prefix_caching=False)
    checks["prompt_tokens_computed_prefix_cache_on"] = jump.prompt_tokens_computed
    checks["prompt_tokens_computed_prefix_cache_off"] = no_cache.prompt_tokens_computed
    checks["prefix_cache_speedup"] = no_cache.seconds / jump.seconds
    runs += [constrained, unconstrained, jump, no_cache]

    print(f"{'run':<56}{'s':>8}{'samples/s':>11}{'tok/s':>9}{'steps':>8}{'prompt tok':>12}")
    for run in runs:
        steps = "" if run.model_steps is None else run.model_steps
        prompt = "" if run.prompt_tokens_computed is None else run.prompt_tokens_computed
        print(f"{run.name:<56}{run.seconds:>8.1f}{run.samples_per_second:>11.2f}{run.tokens_per_second:>9.1f}{steps:>8}{prompt:>12}")
    for key, value in checks.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    if args.json_out:
        args.json_out.write_text(json.dumps({
            "runs": [asdict(run) | {"samples_per_second": run.samples_per_second} for run in runs],
            "checks": checks,
        }, indent=2) + "\n")
    return 0


def _parses(text: str) -> bool:
    try:
        ProductMetadata.model_validate_json(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    sys.exit(main())
