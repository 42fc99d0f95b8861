"""Write a synthetic catalogue in the layout of `Shopify/product-catalogue`.

    out_dir/
      data/<split>-00000-of-00001.parquet   the seven dataset columns
      attributes.jsonl                      line i: richer ground truth of row i
      catalogue.json                        how it was made

`datasets.load_dataset("parquet", data_dir=out_dir)` and
`datasets.load_dataset(str(out_dir))` both read it. Records are made and
written `RECORDS_PER_CHUNK` at a time, so memory does not grow with `n` (all
of them in memory took about 55 kB a record: 55 GB for a million).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from vlm_catalog.data.format import (
    ATTRIBUTES_FILE,
    BENCHMARK_COLUMNS,
    DATA_DIR,
    MANIFEST_FILE,
    CatalogueError,
    catalogue_features,
)
from vlm_catalog.data.synthetic.images import IMAGE_SIZES
from vlm_catalog.data.synthetic.records import RecordFactory, default_factory

GENERATOR_NAME = "vlm-catalog synthetic"
FORMAT_VERSION = 1
COLUMNS = BENCHMARK_COLUMNS
_SPLIT_NAME = re.compile(r"^[A-Za-z0-9_]+$")


def parquet_path(out_dir: str | Path, split: str = "test") -> Path:
    return Path(out_dir) / DATA_DIR / f"{split}-00000-of-00001.parquet"


def _existing_catalogue_files(out_dir: Path) -> list[Path]:
    found = [out_dir / name for name in (MANIFEST_FILE, ATTRIBUTES_FILE)]
    found = [path for path in found if path.exists()]
    data_dir = out_dir / DATA_DIR
    if data_dir.is_dir():
        found += sorted(data_dir.glob("*.parquet"))
    return found


def _check_arguments(out_dir: Path, n: object, seed: object, image_size: str, split: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise CatalogueError(f"n must be a positive integer (the number of records), got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise CatalogueError(f"seed must be an integer, got {seed!r}")
    if image_size not in IMAGE_SIZES:
        raise CatalogueError(
            f"unknown image_size {image_size!r}; choose one of: {', '.join(IMAGE_SIZES)}"
        )
    if not isinstance(split, str) or not _SPLIT_NAME.match(split):
        raise CatalogueError(f"split must be a name like 'test' or 'train', got {split!r}")
    if out_dir.exists() and not out_dir.is_dir():
        raise CatalogueError(f"output path {out_dir} exists and is not a directory")


def _replaced_files(out_dir: Path, overwrite: bool) -> list[Path]:
    """The catalogue files already in `out_dir`, which `overwrite` replaces; refused without it."""
    existing = _existing_catalogue_files(out_dir) if out_dir.is_dir() else []
    if existing and not overwrite:
        raise CatalogueError(
            f"{out_dir} already holds a catalogue ({existing[0].name}); pass overwrite=True "
            "(--overwrite) to replace it"
        )
    return existing


# As the Hugging Face Hub writes image datasets: small row groups, so a reader can
# stream the file (ours streams big groups too, other readers may not).
ROWS_PER_ROW_GROUP = 100
RECORDS_PER_CHUNK = 1000  # records made and written at a time (a multiple of ROWS_PER_ROW_GROUP)


class _ParquetChunks:
    """One parquet file written a chunk of columns at a time: the table, schema (with the `datasets`
    features) and row groups of `ROWS_PER_ROW_GROUP` that `Dataset.to_parquet` wrote, with
    pyarrow's default column options (the image bytes snappy-compressed)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._writer = None

    def write(self, columns: dict[str, list]) -> None:
        import datasets
        import pyarrow.parquet as pq

        table = datasets.Dataset.from_dict(columns, features=catalogue_features()).data.table
        if self._writer is None:
            self._writer = pq.ParquetWriter(str(self.path), table.schema)
        self._writer.write_table(table, row_group_size=ROWS_PER_ROW_GROUP)

    def __enter__(self) -> _ParquetChunks:
        import datasets

        self._bars_were_enabled = not datasets.are_progress_bars_disabled()
        datasets.disable_progress_bars()
        return self

    def __exit__(self, *exc_info) -> None:
        import datasets

        if self._writer is not None:
            self._writer.close()
        if self._bars_were_enabled:
            datasets.enable_progress_bars()


def make_catalog(
    out_dir: str | Path,
    n: int,
    seed: int,
    image_size: str = "small",
    split: str = "test",
    *,
    overwrite: bool = False,
    factory: RecordFactory | None = None,
) -> Path:
    """Generate `n` records from `seed` and write them under `out_dir`; return `out_dir`.

    Record i depends only on (seed, i): a larger `n` appends records. An
    `out_dir` that already holds a catalogue is refused unless `overwrite`,
    which replaces that catalogue's files (and nothing else). The catalogue is
    written in a hidden folder inside `out_dir` (on its file system, where `out_dir`
    may be a link or a mount point; the loader skips hidden folders) and its files
    renamed into place once whole: an error or Ctrl-C midway leaves the old
    catalogue as it was (before, `overwrite` had deleted it first, and a stopped
    run left neither), and a new `out_dir` is removed again.
    `factory` picks another taxonomy; by default the shipped subset is used.
    """
    out_dir = Path(out_dir)
    _check_arguments(out_dir, n, seed, image_size, split)
    factory = factory or default_factory()
    replaced = _replaced_files(out_dir, overwrite)
    made = [folder for folder in (out_dir, *out_dir.parents) if not folder.exists()]  # removed if it fails
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".make-catalog.", suffix=".partial", dir=out_dir))
    except OSError as exc:
        _remove_empty(made)
        raise CatalogueError(f"cannot write {out_dir}: {exc.strerror or exc}") from None
    finished = False
    try:
        (staging / DATA_DIR).mkdir()
        _write_records(staging, n, seed, image_size, split, factory)
        manifest = {
            "generator": GENERATOR_NAME,
            "format_version": FORMAT_VERSION,
            "n": n,
            "seed": seed,
            "image_size": image_size,
            "split": split,
        }
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        written = [parquet_path(Path(), split), Path(ATTRIBUTES_FILE), Path(MANIFEST_FILE)]
        (out_dir / DATA_DIR).mkdir(parents=True, exist_ok=True)
        for name in written:  # each rename replaces the old file of that name at once
            os.replace(staging / name, out_dir / name)
        for path in replaced:  # the old catalogue's other files (another split's parquet)
            if path not in [out_dir / name for name in written]:
                path.unlink(missing_ok=True)
        finished = True
    except OSError as exc:  # a full disk, a folder not writable
        raise CatalogueError(f"writing {out_dir} failed: {exc.strerror or exc}") from None
    finally:  # an error or Ctrl-C midway: the old catalogue stays as it was
        shutil.rmtree(staging, ignore_errors=True)
        if not finished:
            _remove_empty([out_dir / DATA_DIR, *made] if out_dir in made else made)
    return out_dir


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders a failed run made, innermost first, where they are still empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            pass


def _write_records(out_dir: Path, n: int, seed: int, image_size: str, split: str, factory: RecordFactory) -> None:
    """The parquet file and attributes.jsonl, `RECORDS_PER_CHUNK` records made and written at a time."""
    with _ParquetChunks(parquet_path(out_dir, split)) as parquet, \
            (out_dir / ATTRIBUTES_FILE).open("w", encoding="utf-8") as attributes:
        for start in range(0, n, RECORDS_PER_CHUNK):
            records = [factory.make(seed, index, image_size) for index in range(start, min(n, start + RECORDS_PER_CHUNK))]
            parquet.write({
                "product_title": [r.title for r in records],
                "product_description": [r.description for r in records],
                "product_image": [{"bytes": r.image_jpeg, "path": None} for r in records],
                "potential_product_categories": [list(r.candidates) for r in records],
                "ground_truth_category": [r.category for r in records],
                "ground_truth_brand": [r.brand for r in records],
                "ground_truth_is_secondhand": [r.is_secondhand for r in records],
            })
            for record in records:
                attributes.write(json.dumps(record.attributes.model_dump(mode="json")) + "\n")
