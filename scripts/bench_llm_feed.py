#!/usr/bin/env python
"""How long `LLM.extract` keeps the engine waiting before its first step, and in all.

`LLM.chat` / `extract` used to build every record's messages (the mlperf
prompt re-encodes the image) and prepare every prompt (chat template, tokens,
image headers) on the calling thread before the engine's first step: on a GPU
host, device idle time that grows with the list. They now prepare in
background threads while the engine steps (`vlm_catalog/read_ahead.py`).

This runs `LLM.extract` (shipped model, mlperf prompt, per-record schema,
greedy) over a synthetic catalogue at the benchmark's image sizes and
reports the seconds from the call to the engine's first step, the total and
records/s, over `--rounds` runs, each on a fresh `LLM` after one untimed
warm-up run. Run it on two checkouts (`PYTHONPATH=<checkout>`) to compare.

    python scripts/bench_llm_feed.py [--records 256] [--max-tokens 20] [--rounds 2] [--dataset DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from vlm_catalog import LLM
from vlm_catalog.bench.workload_args import add_workload_arguments, workload_records
from vlm_catalog.engine.sampling_params import SamplingParams


def timed_extract(model: Path, records: list, max_tokens: int) -> dict:
    llm = LLM(model)
    engine = llm.engine
    first_step: list[float] = []
    real_step = engine.step

    def step():
        if not first_step:
            first_step.append(time.perf_counter())
        return real_step()

    engine.step = step
    try:
        start = time.perf_counter()
        results = llm.extract(records, sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0))
        seconds = time.perf_counter() - start
    finally:
        engine.close()
    return {
        "records": len(results),
        "seconds_before_first_step": round(first_step[0] - start, 3),
        "seconds": round(seconds, 3),
        "records_per_s": round(len(results) / seconds, 2),
        "failed": sum(not result.ok for result in results),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser, records=256, seed=4242)
    parser.add_argument("--max-tokens", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    if args.records < 1 or args.rounds < 1 or args.max_tokens < 1:
        parser.error("--records, --rounds and --max-tokens must be at least 1")
    records = workload_records(args)
    timed_extract(args.model, records[: min(8, len(records))], args.max_tokens)  # warm-up
    runs = []
    for round_index in range(args.rounds):
        run = timed_extract(args.model, records, args.max_tokens)
        runs.append(run)
        print(f"round {round_index + 1}: {run['seconds_before_first_step']:.2f} s before the first step, "
              f"{run['seconds']:.2f} s in all, {run['records_per_s']:.1f} records/s, {run['failed']} failed")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"records": args.records, "max_tokens": args.max_tokens, "runs": runs}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
