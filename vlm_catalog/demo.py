"""`vlm-catalog demo`: the main job on the shipped default model and sample catalogue.

Extracts ProductMetadata for every record of `data/sample_catalogue` with the
default model (`data/models/tiny-qwen3-vl-moe`), writes the predictions, and
scores them with the benchmark's metric against the random-guess baseline.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vlm_catalog.paths import SAMPLE_CATALOGUE_DIR


def register(subparsers: argparse._SubParsersAction) -> None:
    from vlm_catalog.extract.command import add_extraction_arguments

    parser = subparsers.add_parser(
        "demo", help="extract and score the shipped sample catalogue with the default model",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_extraction_arguments(parser)
    parser.add_argument("--dataset", type=Path, default=SAMPLE_CATALOGUE_DIR)
    parser.add_argument("--out-dir", type=Path, default=Path("scratch/demo"))
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from vlm_catalog.data.loader import load_catalogue
    from vlm_catalog.evaluate.command import resolve_indices
    from vlm_catalog.evaluate.predictions import read_predictions
    from vlm_catalog.evaluate.scoring import score
    from vlm_catalog.extract.command import extract_catalogue

    predictions = args.out_dir / "predictions.jsonl"
    print(f"model: {args.model}\ncatalogue: {args.dataset}")
    summary = extract_catalogue(args, predictions)
    catalogue = load_catalogue(args.dataset, split=args.split)
    report = score(resolve_indices(read_predictions(predictions), catalogue), catalogue.labels())
    print(
        f"\n{summary['records']} records in {summary['seconds']:.1f} s ({summary['records_per_second']:.2f}/s); "
        f"{summary['model_steps']} model steps, {summary['jump_forward_tokens']} tokens by jump-forward\n"
    )
    print(report.format_table())
    (args.out_dir / "report.json").write_text(json.dumps({"extraction": summary, "accuracy": report.to_dict()}, indent=2) + "\n")
    print(f"\nwrote {predictions} and {args.out_dir / 'report.json'}")
    return 0
