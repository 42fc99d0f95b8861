#!/usr/bin/env python
"""What a failed engine step costs the batch job: a clean run against one with poisoned records.

A poisoned record makes every engine step it is in raise (as a bug its image or
grammar meets would). The step's records then run again by bisection
(`vlm_catalog/engine/step_faults.py`); before, they ran again one at a time, a
window of records at batch 1 behind each bad one. This runs `vlm-catalog
extract` in-process over a catalogue twice, clean and with `--poison`
records, and reports for each the engine steps that ran work, the failed
steps, the seconds, and the records written as failures (the poisoned ones
only, when all is well). Run it on two checkouts (`PYTHONPATH=<checkout>`) to
compare.

    python scripts/bench_step_faults.py [--dataset DIR] [--poison 37 ...] [--limit N] [--max-tokens 80] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from vlm_catalog.cli import main as cli_main
from vlm_catalog.engine.llm_engine import LLMEngine
from vlm_catalog.paths import SAMPLE_CATALOGUE_DIR


def run_extract(dataset: Path, poisoned: set[int], limit: int | None, max_tokens: int) -> dict:
    """One `extract` run in-process, with the steps that schedule a poisoned record raising."""
    real_run_step = LLMEngine._run_step
    counts = {"steps": 0, "failed_steps": 0}
    poisoned_ids = {f"batch-{index}" for index in poisoned} | {f"batch-{index}-bounded" for index in poisoned}

    def run_step(engine, output, pending):
        if output.chunks:
            counts["steps"] += 1
        if any(chunk.request.request_id in poisoned_ids for chunk in output.chunks):
            counts["failed_steps"] += 1
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        return real_run_step(engine, output, pending)

    LLMEngine._run_step = run_step
    try:
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "predictions.jsonl"
            argv = ["extract", "--dataset", str(dataset), "--out", str(out), "--max-tokens", str(max_tokens)]
            argv += ["--limit", str(limit)] if limit is not None else []
            started = time.perf_counter()
            status = cli_main(argv)
            seconds = time.perf_counter() - started
            lines = [json.loads(line) for line in out.read_text().splitlines()]
    finally:
        LLMEngine._run_step = real_run_step
    return {
        "exit_status": status, "seconds": round(seconds, 2), **counts, "records": len(lines),
        "failed_records": sorted(int(line["id"]) for line in lines if line["failure"] is not None),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, default=SAMPLE_CATALOGUE_DIR)
    parser.add_argument("--poison", type=int, nargs="+", default=[37], help="record indices whose steps raise")
    parser.add_argument("--limit", type=int, default=None, help="the first N records only")
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    if args.max_tokens < 1 or (args.limit is not None and args.limit < 1):
        parser.error("--max-tokens and --limit must be at least 1")
    report = {"dataset": str(args.dataset), "poisoned": sorted(args.poison), "max_tokens": args.max_tokens}
    for name, poisoned in (("clean", set()), ("poisoned", set(args.poison))):
        run = report[name] = run_extract(args.dataset, poisoned, args.limit, args.max_tokens)
        print(f"{name}: {run['records']} records in {run['seconds']:.1f} s, {run['steps']} engine steps "
              f"({run['failed_steps']} failed), failed records {run['failed_records']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
