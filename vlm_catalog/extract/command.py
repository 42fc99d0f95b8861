"""`vlm-catalog extract`: the batch job over a catalogue (see `vlm_catalog.batch`).

Each line of `--out` is `{"id", "response", "parsed", "finish_reason", "error",
"metrics", "failure"}` (`vlm-catalog eval` reads `id` and `response`), written
as soon as the record finishes. Running the same command again resumes.

Exit status: 0 every selected record answered; 3 the run completed with failed
records (the summary counts each kind); 1 a run-level error (one line on
stderr); 130 interrupted (what finished is on disk).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vlm_catalog.engine.arguments import add_device_arguments, device_options
from vlm_catalog.paths import DEFAULT_MODEL_DIR

EXIT_OK, EXIT_ERROR, EXIT_FAILED_RECORDS, EXIT_INTERRUPTED = 0, 1, 3, 130


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "extract", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_extraction_arguments(parser)
    parser.add_argument("--dataset", type=Path, required=True,
                        help="catalogue: parquet file or folder, `datasets` save_to_disk folder, or JSONL")
    parser.add_argument("--out", type=Path, required=True, help="predictions JSONL (resumed if it exists)")
    parser.add_argument("--overwrite", action="store_true", help="start afresh instead of resuming --out")
    parser.add_argument("--retry-failed", nargs="?", const="all", default=None, metavar="KINDS",
                        help="resuming, run the records that failed again: all of them, or those of the "
                             "comma-separated failure KINDS (image, record, engine, length, answer); their "
                             "old lines are removed first")
    parser.add_argument("--shard", default="0/1", metavar="I/N",
                        help="process shard I of N (records split by a stable hash of their id)")
    parser.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                        help="run with Ray Data on the cluster at ADDRESS (e.g. ray://head:10001 or auto); "
                             "without ADDRESS: the running cluster, else a local one")
    parser.add_argument("--replicas", type=int, default=None,
                        help="with --ray: engine replicas (default: one per GPU, or one per node on CPU)")
    parser.add_argument("--eval", action="store_true",
                        help="score the results with the benchmark's metric (needs ground truth)")
    parser.add_argument("--window", type=int, default=None,
                        help="records in the engine at once: bounds memory (default 64 on CPU, 512 on GPUs)")
    parser.add_argument("--read-ahead", type=int, default=64, metavar="N",
                        help="records read and prepared ahead of the window in background threads, so the "
                             "engine thread only adds them (default 64; 0: prepare each on the engine thread)")
    parser.add_argument("--log-every", type=float, default=30.0, metavar="SECONDS",
                        help="progress log interval when stderr is not a terminal")
    parser.set_defaults(handler=run)


def add_extraction_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR, help="checkpoint directory")
    parser.add_argument("--split", default=None, help='splits to use, e.g. "test" or "train+test"')
    parser.add_argument("--limit", type=int, default=None, help="only the first N records (of the shard)")
    parser.add_argument("--schema", default="product_metadata", help="answer schema (a registered name)")
    parser.add_argument("--prompt-style", default="mlperf", choices=("mlperf", "concise"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=150,
                        help="answer token budget (the free-text brand is bounded to fit it)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="as the benchmark's rules require")
    parser.add_argument("--policy", default="fcfs", choices=("fcfs", "shortest_prompt_first"))
    add_device_arguments(parser)


def settings_from_args(args: argparse.Namespace, out: Path, **overrides):
    from vlm_catalog.batch import BatchError, BatchSettings
    from vlm_catalog.batch.requests import FAILURE_KINDS
    from vlm_catalog.batch.selection import Shard

    try:
        shard = Shard.parse(getattr(args, "shard", "0/1"))
    except ValueError as exc:
        raise BatchError(str(exc)) from None
    retry_failed = getattr(args, "retry_failed", None)
    retry_kinds = () if retry_failed is None else (
        FAILURE_KINDS if retry_failed.strip() == "all"
        else tuple(kind.strip() for kind in retry_failed.split(",") if kind.strip())
    )
    if retry_failed is not None and not retry_kinds:
        raise BatchError(f"--retry-failed {retry_failed!r}: name failure kinds ({', '.join(FAILURE_KINDS)}) or all")
    values = dict(
        dataset=args.dataset, out=out, model=args.model, split=args.split, limit=args.limit,
        schema=args.schema, prompt_style=args.prompt_style, device=args.device, dtype=args.dtype,
        max_tokens=args.max_tokens, enable_prefix_caching=not args.no_prefix_caching,
        scheduling_policy=args.policy, **device_options(args), shard=shard, overwrite=getattr(args, "overwrite", False),
        retry_failed=retry_kinds,
        ray_address=getattr(args, "ray", None), replicas=getattr(args, "replicas", None),
        window=getattr(args, "window", None), read_ahead=getattr(args, "read_ahead", 64), evaluate=getattr(args, "eval", False),
        log_every_s=getattr(args, "log_every", 30.0),
    )
    values.update(overrides)
    return BatchSettings(**values)


def run(args: argparse.Namespace) -> int:
    from vlm_catalog.batch import BatchError, run_batch

    try:
        summary = run_batch(settings_from_args(args, args.out))
    except BatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:  # before the first record started (loading, checking)
        print("interrupted before any record was processed", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(summary.format())
    if summary.interrupted:
        print(f"interrupted: {args.out} holds every finished record; run the same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    if summary.accuracy is not None:
        print()
        print(summary.accuracy.format_table())
    elif args.eval:
        print("--eval: the dataset has no ground truth to score against")
    return EXIT_OK if not summary.file_failures and summary.complete else EXIT_FAILED_RECORDS
