#!/usr/bin/env python
"""The engine with and without async scheduling, on the same records: time and tokens.

With `EngineConfig.async_scheduling`, step N+1 is scheduled and launched before
step N's sampled tokens are read, and the host does its per-token work while
the device computes. On a GPU that hides the host's share of every step; on a
CPU the forward pass runs on the host itself, so there is nothing to hide and
the times should match. Either way the tokens must be the same: the requests
sample as the benchmark does (temperature 0.7, top-p 0.8, top-k 20), seeded per
record, with the mlperf prompt and `--max-tokens` tokens each (ignore_eos).

Runs the two settings in interleaved rounds, each on a fresh engine (no image
cached), after an untimed warm-up of each, and exits 1 if their tokens differ.

    python scripts/bench_async_scheduling.py [--records 128] [--max-tokens 64] [--rounds 2] [--device cuda]
        [--model DIR] [--dataset DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from vlm_catalog import LLM
from vlm_catalog.bench.interleaved import interleaved_rounds
from vlm_catalog.bench.workload_args import add_workload_arguments, workload_records
from vlm_catalog.engine.generation_config import QWEN3_VL_SAMPLING
from vlm_catalog.preprocess.prompt import build_messages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser, records=128, seed=4242)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.records < 1 or args.rounds < 1 or args.max_tokens < 1:
        parser.error("--records, --rounds and --max-tokens must be at least 1")
    records = workload_records(args)
    conversations = [build_messages(record) for record in records]
    params = [QWEN3_VL_SAMPLING.params(max_tokens=args.max_tokens, ignore_eos=True, seed=index)
              for index in range(len(records))]

    def run(setting: bool, count: int = len(records)):
        llm = LLM(args.model, device=args.device, async_scheduling=setting)  # fresh: no image cached yet
        start = time.perf_counter()
        outputs = llm.chat(conversations[:count], params[:count])
        seconds = time.perf_counter() - start
        llm.engine.close()
        row = {"async_scheduling": setting, "records": len(outputs), "seconds": round(seconds, 3),
               "samples_per_s": round(len(outputs) / seconds, 2),
               "generated_tokens": sum(len(output.token_ids) for output in outputs)}
        return row, [output.token_ids for output in outputs]

    rows, answers = interleaved_rounds((False, True), args.rounds, run, warm_up=lambda setting: run(setting, 8))
    same = answers[False] == answers[True]
    print(f"same tokens with and without async scheduling: {same}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": args.device, "max_tokens": args.max_tokens, "rows": rows, "same_tokens": same},
                      handle, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
