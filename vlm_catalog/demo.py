"""`vlm-catalog demo`: the main job on the shipped default model and sample catalogue.

Extracts ProductMetadata for every record of `data/sample_catalogue` with the
default model (`data/models/tiny-qwen3-vl-moe`) through the batch job (as
`vlm-catalog extract --overwrite` would), writes the predictions, and scores
them with the benchmark's metric against the random-guess baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vlm_catalog.paths import SAMPLE_CATALOGUE_DIR


def register(subparsers: argparse._SubParsersAction) -> None:
    from vlm_catalog.extract.command import add_extraction_arguments

    parser = subparsers.add_parser(
        "demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_extraction_arguments(parser)
    parser.add_argument("--dataset", type=Path, default=SAMPLE_CATALOGUE_DIR)
    parser.add_argument("--out-dir", type=Path, default=Path("scratch/demo"))
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from vlm_catalog.batch import BatchError, run_batch
    from vlm_catalog.extract.command import settings_from_args
    from vlm_catalog.report_file import ReportFileError, check_report_path, write_report

    predictions = args.out_dir / "predictions.jsonl"
    report_path = args.out_dir / "report.json"
    print(f"model: {args.model}\ncatalogue: {args.dataset}")
    try:
        if args.out_dir.exists() and not args.out_dir.is_dir():
            raise BatchError(f"--out-dir {args.out_dir} is a file; give a folder for the predictions and report")
        check_report_path(report_path, option="--out-dir", inputs=(args.dataset, args.model))
        summary = run_batch(settings_from_args(args, predictions, overwrite=True, evaluate=True))
    except (BatchError, ReportFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM before the first record started
        print("interrupted before any record was processed", file=sys.stderr)
        return 130
    if summary.interrupted:
        print("interrupted", file=sys.stderr)
        return 130
    stats = summary.as_dict()
    print(
        f"\n{stats['records']} records in {stats['seconds']:.1f} s ({stats['records_per_second']:.2f}/s); "
        f"{stats['model_steps']} model steps, {stats['jump_forward_tokens']} tokens by jump-forward"
        + (f"; {stats['failed']} failed" if stats["failed"] else "") + "\n"
    )
    if summary.accuracy is None:
        print("the catalogue has no ground truth to score against")
        return 0
    print(summary.accuracy.format_table())
    report = {"extraction": stats, "accuracy": summary.accuracy.to_dict()}
    try:
        write_report(report_path, json.dumps(report, indent=2) + "\n", option="--out-dir")
    except ReportFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"\nwrote {predictions} and {report_path}")
    return 0
