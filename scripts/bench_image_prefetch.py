#!/usr/bin/env python
"""Image prefetching on and off: how long engine steps wait for image decodes, and throughput.

Runs the engine over a synthetic catalogue with the benchmark's image sizes
(`--image-size realistic`, 500-2000 px JPEGs) and the mlperf prompt, each
record generating `--max-tokens` greedy tokens, alternately with
`image_prefetch_bytes=0` (every image decoded when a step first needs it; the
CPU default) and the CUDA default budget (the next steps' images decoded while
a step runs). Each
run starts from a fresh engine, after one untimed warm-up run per setting.

Reports per run: seconds, records/s, images taken from a prefetch, and the
seconds steps waited for image pixels; and whether both settings generated
the same tokens. On a CPU-only machine the forward pass uses the same cores
as the decode threads, so there the wait shrinks more than the total time;
on a GPU host the waiting time is device idle time.

    python scripts/bench_image_prefetch.py [--records 128] [--rounds 2] [--dataset DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from vlm_catalog import LLM, SamplingParams
from vlm_catalog.bench.interleaved import interleaved_rounds
from vlm_catalog.bench.workload_args import add_workload_arguments, workload_records
from vlm_catalog.data.format import CatalogueError
from vlm_catalog.engine.config import CUDA_IMAGE_PREFETCH_BYTES
from vlm_catalog.preprocess.prompt import build_messages


def timed_run(model: Path, conversations, params: SamplingParams, prefetch_bytes: int) -> tuple[dict, list]:
    llm = LLM(model, image_prefetch_bytes=prefetch_bytes)
    try:
        start = time.perf_counter()
        outputs = llm.chat(conversations, params)
        seconds = time.perf_counter() - start
        stats = llm.engine.stats
        run = {
            "image_prefetch_bytes": prefetch_bytes,
            "seconds": round(seconds, 3),
            "records_per_s": round(len(conversations) / seconds, 2),
            "images_prefetched": stats.num_images_prefetched,
            "seconds_waiting_for_images": round(stats.seconds_waiting_for_images, 3),
            "seconds_in_prefill_steps": round(stats.seconds_in_prefill_steps, 3),
        }
    finally:
        llm.engine.close()
    return run, [output.token_ids for output in outputs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser, records=128, seed=9001)
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per record")
    parser.add_argument("--rounds", type=int, default=2, help="timed runs per setting, interleaved")
    parser.add_argument("--prefetch-bytes", type=int, default=CUDA_IMAGE_PREFETCH_BYTES,
                        help="the budget of the prefetching runs (default: the CUDA default)")
    parser.add_argument("--json", dest="json_out", type=Path)
    args = parser.parse_args(argv)

    try:
        records = workload_records(args)
    except CatalogueError as exc:  # no such --dataset, or not a catalogue
        print(f"error: {exc}", file=sys.stderr)
        return 2
    conversations = [build_messages(record) for record in records]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0, output_kind="final_only")
    settings = (0, args.prefetch_bytes)
    runs, tokens = interleaved_rounds(
        settings, args.rounds, lambda budget: timed_run(args.model, conversations, params, budget),
        warm_up=lambda budget: timed_run(args.model, conversations[:4], params, budget),
    )
    report = {"records": len(records), "image_size": args.image_size, "max_tokens": args.max_tokens, "runs": runs,
              "same_tokens": tokens[settings[0]] == tokens[settings[1]]}
    print(f"same tokens with and without prefetching: {report['same_tokens']}")
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2))
    return 0 if report["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
