#!/usr/bin/env python
"""The batch job's record feeding: prepared on the engine thread, or read ahead in background threads.

Runs the batch job's runner (`vlm_catalog.batch.local.run_items`: the mlperf
prompt, the per-record schema, greedy) over a synthetic catalogue with the
benchmark's image sizes, alternately with `--read-ahead 0` (each record read,
built and tokenised on the engine thread when a window slot frees) and the
default read-ahead. Each run starts from a fresh engine, after one untimed
warm-up run per setting.

Reports per run: seconds, records/s, and the engine thread's time spent
getting records ready, split into what the first step waited for and the
rest (per record). With the read-ahead a step takes at most `--read-ahead`
new records, so the first step waits for that many and the window fills over
the next steps; without it the first step waits for the whole window. On a
GPU host that time is device idle time. Also whether both settings wrote the
same answers. On the 2-core CPU machine the
preparing threads share the cores with the forward pass, so the total time
changes less than the waiting does.

    python scripts/bench_batch_feed.py [--records 256] [--rounds 2] [--window 64] [--dataset DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from vlm_catalog.batch.job import BatchSettings, build_engine, build_request_builder
from vlm_catalog.batch.local import DEFAULT_READ_AHEAD, run_items
from vlm_catalog.bench.interleaved import interleaved_rounds
from vlm_catalog.bench.workload_args import add_workload_arguments, workload_catalogue
from vlm_catalog.data.format import CatalogueError
from vlm_catalog.data.loader import load_catalogue


def timed_run(settings: BatchSettings, read_ahead: int, limit: int | None = None) -> tuple[dict, dict[str, str]]:
    engine = build_engine(settings)
    try:
        builder = build_request_builder(settings, engine.tokenizer)
        catalogue = load_catalogue(settings.dataset)
        indices = range(min(limit or len(catalogue), len(catalogue)))
        lines = []
        start = time.perf_counter()
        feed = run_items(engine, builder, catalogue.items(indices), lines.append, settings.window,
                         read_ahead=read_ahead)
        seconds = time.perf_counter() - start
    finally:
        engine.close()
    first_step_records = min(read_ahead or settings.window, settings.window, len(lines))  # what the first step took
    after_first = len(lines) - first_step_records
    waiting_after_first = feed.seconds_waiting_for_records - feed.seconds_waiting_before_first_step
    run = {
        "read_ahead": read_ahead,
        "records": len(lines),
        "seconds": round(seconds, 3),
        "records_per_s": round(len(lines) / seconds, 2),
        "seconds_waiting_for_records": round(feed.seconds_waiting_for_records, 3),
        "seconds_waiting_before_first_step": round(feed.seconds_waiting_before_first_step, 3),
        "ms_waiting_per_record_after_first_step": round(1e3 * waiting_after_first / after_first, 3) if after_first else None,
        "failed": sum(line.failure is not None for line in lines),
    }
    return run, {line.id: line.response for line in lines}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser, records=256, seed=4242)
    parser.add_argument("--max-tokens", type=int, default=150)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--read-ahead", type=int, default=DEFAULT_READ_AHEAD, help="the read-ahead runs' depth")
    parser.add_argument("--rounds", type=int, default=2, help="timed runs per setting, interleaved")
    parser.add_argument("--json", dest="json_out", type=Path)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as scratch:
        try:
            dataset = workload_catalogue(args, scratch)
            load_catalogue(dataset)  # refused before an engine is built (each run reads it again)
        except CatalogueError as exc:  # no such --dataset, or not a catalogue
            print(f"error: {exc}", file=sys.stderr)
            return 2
        settings = BatchSettings(dataset=dataset, out=Path(scratch) / "unused.jsonl", model=args.model,
                                 max_tokens=args.max_tokens, window=args.window)
        depths = (0, args.read_ahead)
        runs, answers = interleaved_rounds(depths, args.rounds, lambda depth: timed_run(settings, depth, args.records),
                                           warm_up=lambda depth: timed_run(settings, depth, limit=4))
    report = {"records": runs[0]["records"], "image_size": args.image_size, "max_tokens": args.max_tokens,
              "window": args.window, "runs": runs, "same_answers": answers[depths[0]] == answers[depths[1]]}
    print(f"same answers with and without read-ahead: {report['same_answers']}")
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2))
    return 0 if report["same_answers"] else 1


if __name__ == "__main__":
    sys.exit(main())
