"""`vlm-catalog make-catalog`: write a synthetic catalogue from the command line."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from vlm_catalog.data.synthetic.images import IMAGE_SIZES


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "make-catalog",
        description=(
            "Generate N synthetic product listings with the columns of Shopify/product-catalogue "
            "and write them as parquet plus attributes.jsonl and catalogue.json. Record i depends "
            "only on (seed, i)."
        ),
    )
    parser.add_argument("--n", type=int, required=True, help="number of records")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--image-size",
        default="small",
        metavar="|".join(IMAGE_SIZES),
        help="small: 128-256 px squares; realistic: the benchmark's JPEG sizes (default small)",
    )
    parser.add_argument(
        "--split", default="test", help="split name of the parquet file (default test)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a catalogue already in --out"
    )
    parser.set_defaults(handler=run)


def _size_on_disk(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def _human_bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def run(args: argparse.Namespace) -> int:
    # Imported here so that `vlm-catalog --help` does not pay for PIL and datasets.
    from vlm_catalog.data.format import CatalogueError
    from vlm_catalog.data.synthetic.generator import make_catalog
    from vlm_catalog.data.taxonomy import TaxonomyError

    started = time.perf_counter()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # stops it as Ctrl-C does
    try:
        out_dir = make_catalog(
            args.out, args.n, args.seed, args.image_size, args.split, overwrite=args.overwrite
        )
    except (CatalogueError, TaxonomyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: interrupted; nothing was written to {args.out} (a catalogue already there is kept)",
              file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    elapsed = time.perf_counter() - started
    print(
        f"wrote {args.n} rows to {out_dir} ({_human_bytes(_size_on_disk(out_dir))} on disk) "
        f"in {elapsed:.1f} s"
    )
    return 0
