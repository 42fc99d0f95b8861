"""Load a product catalogue and yield `ProductRecord`s.

Accepted sources, all with the columns of `Shopify/product-catalogue`:
- a catalogue written by `vlm-catalog make-catalog` (`DIR/data/*.parquet`, plus
  `DIR/attributes.jsonl` with the richer ground truth);
- a local copy of the real dataset (a directory of parquet files named
  `<split>-NNNNN-of-NNNNN.parquet`, as the Hugging Face repository lays them out);
- a single parquet file;
- a directory written by `datasets`' `save_to_disk` (a Dataset or a DatasetDict).

Splits are concatenated in the benchmark's order (train, then test) unless one is
chosen; a record's id is its row index in that concatenation, which is also the
`qsl_idx` MLPerf LoadGen uses. Images stay encoded (bytes) until the preprocessor.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
from PIL import Image, UnidentifiedImageError
from pydantic import ValidationError

from schemas import ProductAttributes, ProductMetadata, ProductRecord
from vlm_catalog.data.format import (
    ATTRIBUTES_FILE,
    CANDIDATES,
    DESCRIPTION,
    IMAGE,
    INPUT_COLUMNS,
    LABEL_COLUMNS,
    TITLE,
    TRUE_BRAND,
    TRUE_CATEGORY,
    TRUE_SECONDHAND,
    CatalogueError,
)

SPLIT_ORDER = ("train", "validation", "test")
_SPLIT_FROM_FILENAME = re.compile(r"^(?P<split>[A-Za-z0-9_]+?)-\d+-of-\d+\.parquet$")


@dataclass(frozen=True)
class RecordLabels:
    """Ground truth of one record, read without touching its image."""

    category: str
    brand: str
    is_secondhand: bool
    candidates: list[str]
    attributes: dict[str, str] | None = None


class Catalogue(Sequence[ProductRecord]):
    """A loaded catalogue: indexable, iterable, lazily materialising records."""

    def __init__(
        self,
        dataset: datasets.Dataset,
        source: str,
        attributes: list[dict[str, Any]] | None = None,
    ) -> None:
        self.source = source
        self._dataset = dataset
        self._attributes = attributes
        self.has_labels = all(column in dataset.column_names for column in LABEL_COLUMNS)

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index: int) -> ProductRecord:  # type: ignore[override]
        if not isinstance(index, int):
            raise TypeError(f"catalogue indices are integers, got {type(index).__name__}")
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} is out of range for {len(self)} records")
        return self._record(index, self._dataset[index])

    def __iter__(self) -> Iterator[ProductRecord]:
        for index, row in enumerate(self._dataset):
            yield self._record(index, row)

    def index_of(self, key: str | int) -> int:
        """Row index of a record id (its row index, as given to predictions)."""
        try:
            index = int(key)
        except (TypeError, ValueError):
            raise KeyError(f"unknown record id {key!r}: ids are row indices") from None
        if not 0 <= index < len(self) or str(key).strip() != str(index):
            raise KeyError(f"unknown record id {key!r}: the catalogue has ids 0..{len(self) - 1}")
        return index

    def labels(self) -> list[RecordLabels]:
        """Ground truth of every record, in order (no image is read)."""
        if not self.has_labels:
            raise CatalogueError(
                f"{self.source}: has no ground truth columns ({', '.join(LABEL_COLUMNS)})"
            )
        columns = self._dataset.select_columns([CANDIDATES, *LABEL_COLUMNS]).to_dict()
        return [
            RecordLabels(
                category=columns[TRUE_CATEGORY][i],
                brand=columns[TRUE_BRAND][i],
                is_secondhand=bool(columns[TRUE_SECONDHAND][i]),
                candidates=list(columns[CANDIDATES][i]),
                attributes=self._attributes[i] if self._attributes is not None else None,
            )
            for i in range(len(self))
        ]

    def check_images(self) -> None:
        """Open every image once; raise `CatalogueError` naming the first unreadable one."""
        for index, row in enumerate(self._dataset.select_columns([IMAGE])):
            _verify_image(_image_bytes(row[IMAGE], index, self.source), index, self.source)

    def _record(self, index: int, row: dict[str, Any]) -> ProductRecord:
        image = _image_bytes(row[IMAGE], index, self.source)
        _verify_image(image, index, self.source)
        ground_truth = None
        if self.has_labels:
            ground_truth = ProductMetadata(
                category=row[TRUE_CATEGORY],
                brand=row[TRUE_BRAND],
                is_secondhand=bool(row[TRUE_SECONDHAND]),
            )
        attributes = None
        if self._attributes is not None:
            attributes = ProductAttributes.model_validate(self._attributes[index])
        try:
            return ProductRecord(
                id=str(index),
                title=row[TITLE] or "",
                description=row[DESCRIPTION] or "",
                image=image,
                candidate_categories=list(row[CANDIDATES] or []),
                ground_truth=ground_truth,
                attributes=attributes,
            )
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}" for error in exc.errors()
            )
            raise CatalogueError(f"{self.source}: record {index}: {problems}") from None


def load_catalogue(path: str | Path, split: str | None = None) -> Catalogue:
    """Load a catalogue from `path`; `split` selects splits, e.g. "test" or "train+test"."""
    path = Path(path)
    if not path.exists():
        raise CatalogueError(f"catalogue not found: {path}")
    splits = _read_splits(path)
    chosen = _choose_splits(splits, split, path)
    dataset = (
        splits[chosen[0]]
        if len(chosen) == 1
        else datasets.concatenate_datasets([splits[name] for name in chosen])
    )
    _check_columns(dataset, path)
    dataset = _keep_images_encoded(dataset)
    _check_candidates(dataset, path)
    attributes = _read_attributes(path, len(dataset)) if path.is_dir() else None
    return Catalogue(dataset, source=str(path), attributes=attributes)


def _read_splits(path: Path) -> dict[str, datasets.Dataset]:
    datasets.disable_progress_bars()
    if path.is_file():
        if path.suffix != ".parquet":
            raise CatalogueError(f"{path}: expected a .parquet file or a directory")
        return {"train": datasets.load_dataset("parquet", data_files=str(path), split="train")}
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            return dict(loaded)
        return {"train": loaded}
    parquet_files = sorted(path.rglob("*.parquet"))
    if not parquet_files:
        raise CatalogueError(f"{path}: holds no parquet files and no dataset saved by `datasets`")
    files_by_split: dict[str, list[str]] = {}
    for file in parquet_files:
        match = _SPLIT_FROM_FILENAME.match(file.name)
        split_name = match.group("split") if match else "train"
        files_by_split.setdefault(split_name, []).append(str(file))
    return {
        name: datasets.load_dataset("parquet", data_files=files, split="train")
        for name, files in files_by_split.items()
    }


def _choose_splits(
    splits: dict[str, datasets.Dataset], requested: str | None, path: Path
) -> list[str]:
    if requested is None:
        known = [name for name in SPLIT_ORDER if name in splits]
        return known + sorted(name for name in splits if name not in SPLIT_ORDER)
    chosen = [name.strip() for name in requested.split("+")]
    missing = [name for name in chosen if name not in splits]
    if missing:
        raise CatalogueError(
            f"{path}: no split {', '.join(missing)}; available: {', '.join(sorted(splits))}"
        )
    return chosen


def _check_columns(dataset: datasets.Dataset, path: Path) -> None:
    missing = [column for column in INPUT_COLUMNS if column not in dataset.column_names]
    if missing:
        raise CatalogueError(
            f"{path}: missing column(s) {', '.join(missing)}; a catalogue needs "
            f"{', '.join(INPUT_COLUMNS)} (and {', '.join(LABEL_COLUMNS)} for evaluation)"
        )
    partial_labels = [column for column in LABEL_COLUMNS if column in dataset.column_names]
    if partial_labels and len(partial_labels) != len(LABEL_COLUMNS):
        absent = sorted(set(LABEL_COLUMNS) - set(partial_labels))
        raise CatalogueError(f"{path}: has some ground-truth columns but not {', '.join(absent)}")


def _keep_images_encoded(dataset: datasets.Dataset) -> datasets.Dataset:
    feature = dataset.features[IMAGE]
    if isinstance(feature, datasets.Image) and feature.decode:
        return dataset.cast_column(IMAGE, datasets.Image(decode=False))
    return dataset


def _check_candidates(dataset: datasets.Dataset, path: Path) -> None:
    candidate_lists = dataset.select_columns([CANDIDATES]).to_dict()[CANDIDATES]
    empty = [index for index, candidates in enumerate(candidate_lists) if not candidates]
    if empty:
        shown = ", ".join(str(index) for index in empty[:5])
        more = f" and {len(empty) - 5} more" if len(empty) > 5 else ""
        raise CatalogueError(f"{path}: empty candidate category list in record(s) {shown}{more}")


def _read_attributes(path: Path, num_rows: int) -> list[dict[str, Any]] | None:
    attributes_path = path / ATTRIBUTES_FILE
    if not attributes_path.is_file():
        return None
    lines = [line for line in attributes_path.read_text(encoding="utf-8").splitlines() if line]
    if len(lines) != num_rows:
        raise CatalogueError(
            f"{attributes_path}: has {len(lines)} lines for {num_rows} records"
        )
    try:
        return [json.loads(line) for line in lines]
    except json.JSONDecodeError as exc:
        raise CatalogueError(f"{attributes_path}: line {exc.lineno} is not JSON") from None


def _image_bytes(value: Any, index: int, source: str) -> bytes:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, dict):
        if value.get("bytes"):
            return bytes(value["bytes"])
        if value.get("path"):
            image_path = Path(value["path"])
            if image_path.is_file():
                return image_path.read_bytes()
            raise CatalogueError(f"{source}: record {index}: image file not found: {image_path}")
    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.save(buffer, format=value.format or "PNG")
        return buffer.getvalue()
    raise CatalogueError(f"{source}: record {index}: has no image")


def _verify_image(data: bytes, index: int, source: str) -> None:
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise CatalogueError(f"{source}: record {index}: unreadable image ({exc})") from None
