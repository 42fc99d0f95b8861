"""The model and catalogue options the engine benchmark scripts share (scripts/bench_*.py)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from schemas import ProductRecord
from vlm_catalog.data.loader import load_catalogue
from vlm_catalog.data.synthetic.generator import make_catalog
from vlm_catalog.paths import DEFAULT_MODEL_DIR


def add_workload_arguments(parser: argparse.ArgumentParser, records: int, seed: int) -> None:
    """--model, and the catalogue: --dataset, or a synthetic one of --records at --seed and --image-size."""
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--records", type=int, default=records)
    parser.add_argument("--seed", type=int, default=seed)
    parser.add_argument("--image-size", choices=("small", "realistic"), default="realistic")
    parser.add_argument("--dataset", type=Path, help="use this catalogue instead of generating one")


def workload_catalogue(args: argparse.Namespace, scratch: str | Path) -> Path:
    """`--dataset`, or the synthetic catalogue the arguments describe, generated under `scratch`."""
    return args.dataset or make_catalog(Path(scratch) / "catalogue", args.records, args.seed, args.image_size)


def workload_records(args: argparse.Namespace) -> list[ProductRecord]:
    """The first `--records` records of the workload's catalogue, read into memory (images included)."""
    with tempfile.TemporaryDirectory() as scratch:
        catalogue = load_catalogue(workload_catalogue(args, scratch))
        return [item.record for item in catalogue.items(range(min(args.records, len(catalogue))))]
