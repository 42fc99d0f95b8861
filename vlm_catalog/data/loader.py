"""Load a product catalogue and yield `ProductRecord`s, one bad record never stopping the rest.

Accepted sources, all with the columns of `Shopify/product-catalogue`:
- a catalogue written by `vlm-catalog make-catalog` (`DIR/data/*.parquet`, plus
  `DIR/attributes.jsonl` with the richer ground truth);
- a local copy of the real dataset (a directory of parquet files named
  `<split>-NNNNN-of-NNNNN.parquet`, as the Hugging Face repository lays them out);
- a single parquet file;
- a directory written by `datasets`' `save_to_disk` (a Dataset or a DatasetDict);
- a JSONL file, one record per line, with the dataset's column names (or the
  short names `title`, `description`, `image`, `candidates`, `category`,
  `brand`, `is_secondhand`); its image is a path relative to the JSONL's folder.

Splits are concatenated in the benchmark's order (train, then test) unless one is
chosen; a record's id is its row index in that concatenation, which is also the
`qsl_idx` MLPerf LoadGen uses. Images stay encoded (bytes) until the preprocessor.

Parquet is read with pyarrow in slices of 64 rows, streamed page by page even
when one row group holds the whole file, and JSONL one line at a time, so
iterating a catalogue holds one slice (or line) of raw data, never the whole
dataset or a whole row group.

Each row is validated against the column types with no coercion: a title that
is the integer 0, candidates stored as one string, or `ground_truth_is_secondhand`
stored as the string "no" are errors naming the record and the column, not
`""`, a list of characters or `True`. A null title or description reads as the
empty text (the reference harness would put the word `None` in the prompt; this
departs from it only for a dataset with such nulls). An image is checked from its header (format, size, pixel limit)
without decoding its pixels. An image given as a path must be a relative path
resolving inside the dataset's folder.

Two ways to read: `catalogue[i]` and iteration raise `CatalogueError` for a
bad record (what evaluation and benchmarks want); `catalogue.items(indices)`
yields a `CatalogueItem` per record, holding either the record or the reason
it is unusable (what the batch job wants: a bad record fails alone).
"""

from __future__ import annotations

import bisect
import io
import itertools
import json
import re
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from PIL import Image
from pydantic import ValidationError

from schemas import ProductAttributes, ProductMetadata, ProductRecord
from vlm_catalog.data.format import (
    ATTRIBUTES_FILE,
    CANDIDATES,
    DESCRIPTION,
    IMAGE,
    INPUT_COLUMNS,
    LABEL_COLUMNS,
    MANIFEST_FILE,
    SHORT_COLUMN_NAMES,
    TITLE,
    TRUE_BRAND,
    TRUE_CATEGORY,
    TRUE_SECONDHAND,
    CatalogueError,
)
from vlm_catalog.data.jsonl import JsonlLine, read_lines
from vlm_catalog.error_text import one_line, validation_problems
from vlm_catalog.lfs_pointer import first_lfs_pointer, is_lfs_pointer, pointer_message
from vlm_catalog.paths import shipped_data_hint
from vlm_catalog.preprocess.image_decode import (
    DEFAULT_MAX_DECODE_PIXELS,
    ImageDecodeError,
    probe_image_bytes,
)

SPLIT_ORDER = ("train", "validation", "test")
# a shard's split from its name, as `datasets` reads the Hub's layouts: "test-00000-of-00001.parquet",
# and older `push_to_hub` names with a fingerprint, "train-00000-of-00002-a1b2c3d4e5f60718.parquet"
_SPLIT_FROM_FILENAME = re.compile(r"^(?P<split>[A-Za-z0-9_]+?)-\d+-of-\d+(?:-[0-9a-f]+)?\.parquet$")
# An image file read from disk larger than this is refused before it is read.
MAX_IMAGE_FILE_BYTES = 128 * 2**20
# Parquet is read in slices of this many rows (64 realistic product photos are a few MB),
# through a read buffer of this size, whatever the size of the file's row groups.
PARQUET_ROWS_PER_READ = 64
PARQUET_READ_BUFFER_BYTES = 2**20
# Label columns (no images: a few KB a row as Python values) are read this many rows at a time.
COLUMN_ROWS_PER_READ = 4096

__all__ = [
    "Catalogue",
    "CatalogueError",
    "CatalogueItem",
    "RecordLabels",
    "SPLIT_ORDER",
    "load_catalogue",
]


@dataclass(frozen=True, slots=True)
class RecordLabels:
    """Ground truth of one record, read without touching its image."""

    category: str
    brand: str
    is_secondhand: bool
    candidates: list[str]
    attributes: dict[str, str] | None = None


@dataclass(frozen=True)
class CatalogueItem:
    """One row of a catalogue: its record, or why it has none.

    `kind` classifies the problem: "image" (missing, unreadable, refused or
    outside the dataset's folder) or "record" (a missing or wrongly typed
    column, an empty candidate list, a line that is not JSON).
    """

    index: int
    record: ProductRecord | None = None
    error: str | None = None
    kind: str | None = None

    @property
    def id(self) -> str:
        return str(self.index)


class _RecordProblem(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


# ------------------------------------------------------------------ row sources
class _Rows(Protocol):
    """Raw rows by index: what each on-disk layout provides."""

    column_names: list[str]
    input_files: list[Path]

    def __len__(self) -> int: ...

    def rows(self, start: int, stop: int) -> Iterator[dict[str, Any] | str]:
        """Rows start..stop-1 as dicts of raw values (a str: why the row cannot be read)."""
        ...

    def column_slices(self, names: Sequence[str]) -> Iterator[dict[str, list[Any]]]:
        """Columns' raw values by name, slice after slice of at most `COLUMN_ROWS_PER_READ` rows, every
        row in order (`Unreadable` where the file's data is damaged). A whole column of a million
        rows as Python values was gigabytes held at once."""
        ...


class _ParquetRows:
    """Parquet files read with pyarrow in slices of at most `rows_per_read` rows.

    A row group can hold a whole dataset (pandas and pyarrow write up to a
    million rows per group by default), so a group is never read whole: one
    batch iterator per row group streams it page by page (`buffer_size`), and
    only the current slice is held as Python values. Reading forward continues
    the iterator; reading backward, or another row group, starts a new one.
    """

    def __init__(self, files: Sequence[Path], rows_per_read: int = PARQUET_ROWS_PER_READ) -> None:
        import pyarrow.parquet as pq

        if rows_per_read < 1:
            raise ValueError(f"rows_per_read must be >= 1, got {rows_per_read}")
        self.rows_per_read = rows_per_read
        self.input_files = [Path(file) for file in files]
        self._files = []
        self._starts: list[int] = []  # global index of each row group's first row
        self._groups: list[tuple[int, int]] = []  # (file number, row group number)
        total = 0
        names: list[str] | None = None
        for number, file in enumerate(self.input_files):
            try:
                # buffered: pages are read as they are decoded, not whole column chunks at once
                parquet = pq.ParquetFile(file, buffer_size=PARQUET_READ_BUFFER_BYTES, pre_buffer=False)
            except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
                if first_lfs_pointer([file]) is not None:
                    raise CatalogueError(pointer_message(file)) from None
                raise CatalogueError(f"{file}: is not a readable parquet file ({exc})") from None
            self._files.append(parquet)
            file_names = parquet.schema_arrow.names
            if names is None:
                names = file_names
            elif set(file_names) != set(names):
                raise CatalogueError(f"{file}: has columns {file_names}, the other files {names}")
            for group in range(parquet.metadata.num_row_groups):
                self._starts.append(total)
                self._groups.append((number, group))
                total += parquet.metadata.row_group(group).num_rows
        self._num_rows = total
        self.column_names = list(names or [])
        self._cursor: _GroupCursor | None = None

    def __len__(self) -> int:
        return self._num_rows

    def _slice_containing(self, index: int) -> tuple[int, list[dict[str, Any]]]:
        """(global index of its first row, rows) of the slice that holds row `index`."""
        group = bisect.bisect_right(self._starts, index) - 1
        cursor = self._cursor
        if cursor is None or cursor.group != group or index < cursor.start:
            self._cursor = None  # drop the old slice before reading anew
            file_number, group_number = self._groups[group]
            batches = self._files[file_number].iter_batches(
                batch_size=self.rows_per_read, row_groups=[group_number]
            )
            cursor = self._cursor = _GroupCursor(group, self._starts[group], batches)
        if index >= cursor.start + len(cursor.rows):
            cursor.start += len(cursor.rows)
            cursor.rows = []  # freed before the next slice is converted
            batch = next(cursor.batches)
            while index >= cursor.start + batch.num_rows:  # skipped slices stay Arrow data
                cursor.start += batch.num_rows
                batch = next(cursor.batches)
            cursor.rows = batch.to_pylist()
        return cursor.start, cursor.rows

    def rows(self, start: int, stop: int) -> Iterator[dict[str, Any] | str]:
        """Rows start..stop-1. Where a row group's data is damaged (a corrupt page, a truncated
        file), the rest of that group cannot be found: each of its rows from there is a str
        saying so, and reading goes on with the next group."""
        index = start
        while index < stop:
            try:
                first, rows = self._slice_containing(index)
            except Exception as exc:  # pyarrow raises OSError, ArrowInvalid, ... for damaged data
                self._cursor = None
                group = bisect.bisect_right(self._starts, index) - 1
                group_stop = self._starts[group + 1] if group + 1 < len(self._starts) else self._num_rows
                file_number, group_number = self._groups[group]
                reason = (f"{self.input_files[file_number]}: row group {group_number} cannot be read from row "
                          f"{index} on ({one_line(exc)})")
                end = min(stop, group_stop)
                yield from [reason] * (end - index)
                index = end
                continue
            take = min(stop, first + len(rows)) - index
            yield from rows[index - first:index - first + take]
            index += take

    def column_slices(self, names: Sequence[str]) -> Iterator[dict[str, list[Any | Unreadable]]]:
        for file_number, group_number in self._groups:
            read = 0
            try:
                batches = self._files[file_number].iter_batches(
                    batch_size=COLUMN_ROWS_PER_READ, row_groups=[group_number], columns=list(names)
                )
                for batch in batches:
                    yield {name: batch.column(name).to_pylist() for name in names}
                    read += batch.num_rows
            except Exception:  # damaged data, as in `rows`: each column alone, to keep the readable ones
                yield {name: self._rest_of_column(file_number, group_number, name, read) for name in names}

    def _rest_of_column(self, file_number: int, group_number: int, name: str, skip: int) -> list[Any | Unreadable]:
        """A row group's values of one column from row `skip` of the group on; an `Unreadable` for
        each row from where its data is damaged."""
        parquet = self._files[file_number]
        num_rows = parquet.metadata.row_group(group_number).num_rows - skip
        values: list[Any | Unreadable] = []
        try:
            for batch in parquet.iter_batches(batch_size=COLUMN_ROWS_PER_READ, row_groups=[group_number], columns=[name]):
                column = batch.column(name)
                if skip < len(column):
                    values.extend(column.slice(skip).to_pylist())
                skip = max(0, skip - len(column))
        except Exception as exc:
            unreadable = Unreadable(f"{self.input_files[file_number]}: row group {group_number} of column {name!r} "
                                    f"cannot be read ({one_line(exc)})")
            values.extend([unreadable] * (num_rows - len(values)))
        return values


@dataclass(frozen=True)
class Unreadable:
    """A value the file holds but cannot give back (damaged data); `reason` says where and why."""

    reason: str


@dataclass
class _GroupCursor:
    """Where `_ParquetRows` is in one row group: the slice in hand and the iterator past it."""

    group: int
    start: int  # global index of the first row of `rows`
    batches: Iterator[Any]  # pyarrow RecordBatches of the rest of the group
    rows: list[dict[str, Any]] = field(default_factory=list)


class _DatasetRows:
    """A `datasets.Dataset` (from `save_to_disk`), images kept encoded."""

    def __init__(self, dataset, input_files: list[Path]) -> None:
        import datasets

        feature = dataset.features.get(IMAGE)
        if isinstance(feature, datasets.Image) and feature.decode:
            dataset = dataset.cast_column(IMAGE, datasets.Image(decode=False))
        # a dataset saved with a format (numpy, pandas) would give arrays for lists and flags
        self._dataset = dataset.with_format(None)
        self.column_names = list(dataset.column_names)
        self.input_files = input_files

    def __len__(self) -> int:
        return len(self._dataset)

    def rows(self, start: int, stop: int) -> Iterator[dict[str, Any]]:
        for batch_start in range(start, stop, 64):
            columns = self._dataset[batch_start:min(stop, batch_start + 64)]
            names = list(columns)
            for values in zip(*(columns[name] for name in names)):
                yield dict(zip(names, values))

    def column_slices(self, names: Sequence[str]) -> Iterator[dict[str, list[Any]]]:
        selected = self._dataset.select_columns(list(names))
        for start in range(0, len(selected), COLUMN_ROWS_PER_READ):
            yield selected[start:start + COLUMN_ROWS_PER_READ]


class _JsonlRows:
    """A JSONL file: one record per non-blank line, read by byte offset."""

    def __init__(self, path: Path) -> None:
        self.input_files = [path]
        self._path = path
        self._offsets = array("Q")
        first: dict[str, Any] | None = None
        with path.open("rb") as handle:
            for line in read_lines(handle):
                if not line.is_blank:
                    self._offsets.append(line.offset)
                    if first is None:  # the columns of the first line that is a JSON object
                        parsed = _parse_json_line(line)
                        first = parsed if isinstance(parsed, dict) else None
        self.column_names = list(first) if isinstance(first, dict) else []

    def __len__(self) -> int:
        return len(self._offsets)

    def rows(self, start: int, stop: int) -> Iterator[dict[str, Any] | str]:
        with self._path.open("rb") as handle:
            if start < stop:
                handle.seek(self._offsets[start])
            produced = start
            for line in read_lines(handle):
                if produced >= stop:
                    return
                if not line.is_blank:
                    produced += 1
                    yield _parse_json_line(line)

    def column_slices(self, names: Sequence[str]) -> Iterator[dict[str, list[Any]]]:
        """In one pass over the file (a pass per column parsed it 4 times to score)."""
        for start in range(0, len(self), COLUMN_ROWS_PER_READ):
            values: dict[str, list[Any]] = {name: [] for name in names}
            for row in self.rows(start, min(len(self), start + COLUMN_ROWS_PER_READ)):
                for name, column in values.items():
                    column.append(row.get(name) if isinstance(row, dict) else None)
            yield values


def _parse_json_line(line: JsonlLine) -> dict[str, Any] | str:
    """A JSONL catalogue line as a row (short column names mapped), or why it is unusable."""
    value = _json_object(line)
    if isinstance(value, str):
        return value
    return {SHORT_COLUMN_NAMES.get(key, key): item for key, item in value.items()}


def _json_object(line: JsonlLine) -> dict[str, Any] | str:
    if line.raw is None:
        return line.too_long_message()
    try:
        value = json.loads(line.raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return f"the line is not JSON ({exc})"
    if not isinstance(value, dict):
        return f"the line is a JSON {type(value).__name__}, not an object"
    return value


class _ConcatRows:
    """Splits one after the other (train, then test)."""

    def __init__(self, parts: list[_Rows]) -> None:
        self._parts = parts
        self._starts = []
        total = 0
        for part in parts:
            self._starts.append(total)
            total += len(part)
        self._num_rows = total
        self.column_names = parts[0].column_names
        for part in parts[1:]:
            if set(part.column_names) != set(self.column_names):
                raise CatalogueError(
                    f"the splits have different columns: {sorted(part.column_names)} and {sorted(self.column_names)}"
                )
        self.input_files = [file for part in parts for file in part.input_files]

    def __len__(self) -> int:
        return self._num_rows

    def rows(self, start: int, stop: int) -> Iterator[dict[str, Any] | str]:
        for part, part_start in zip(self._parts, self._starts):
            lo, hi = max(start, part_start), min(stop, part_start + len(part))
            if lo < hi:
                yield from part.rows(lo - part_start, hi - part_start)

    def column_slices(self, names: Sequence[str]) -> Iterator[dict[str, list[Any]]]:
        for part in self._parts:
            yield from part.column_slices(names)


# -------------------------------------------------------------------- catalogue
class Catalogue(Sequence[ProductRecord]):
    """A loaded catalogue: indexable, iterable, lazily materialising records."""

    def __init__(
        self,
        rows: _Rows,
        source: str,
        attributes: _AttributeLines | None = None,
        image_root: Path | None = None,
    ) -> None:
        self.source = source
        self._rows = rows
        self._attributes = attributes
        self._image_root = image_root
        self.has_labels = all(column in rows.column_names for column in LABEL_COLUMNS)

    @property
    def image_root(self) -> Path | None:
        """The folder image paths are relative to (and must stay inside)."""
        return self._image_root

    @property
    def input_files(self) -> list[Path]:
        """Every file the catalogue is read from (an output must never be one of them)."""
        return list(self._rows.input_files)

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> ProductRecord:  # type: ignore[override]
        if not isinstance(index, int):
            raise TypeError(f"catalogue indices are integers, got {type(index).__name__}")
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} is out of range for {len(self)} records")
        return _record_or_raise(next(self.items([index])), self.source)

    def __iter__(self) -> Iterator[ProductRecord]:
        for item in self.items():
            yield _record_or_raise(item, self.source)

    def items(self, indices: Iterable[int] | None = None) -> Iterator[CatalogueItem]:
        """One `CatalogueItem` per index (all records when None), in the order given.

        Never raises for a bad record: the item carries the error instead. Runs
        of consecutive indices are read together, one row group at a time.
        """
        indices = range(len(self)) if indices is None else indices
        run: list[int] = []
        for index in indices:
            if not 0 <= index < len(self):
                raise IndexError(f"record {index} is out of range for {len(self)} records")
            if run and (index != run[-1] + 1 or len(run) >= 256):
                yield from self._read_run(run[0], run[-1] + 1)
                run = []
            run.append(index)
        if run:
            yield from self._read_run(run[0], run[-1] + 1)

    def _read_run(self, start: int, stop: int) -> Iterator[CatalogueItem]:
        for index, row in zip(range(start, stop), self._rows.rows(start, stop)):
            try:
                yield CatalogueItem(index, record=self._record(index, row))
            except _RecordProblem as problem:
                yield CatalogueItem(index, error=str(problem), kind=problem.kind)

    def index_of(self, key: str | int) -> int:
        """Row index of a record id (its row index, as given to predictions)."""
        try:
            index = int(key)
        except (TypeError, ValueError):
            raise KeyError(f"unknown record id {key!r}: ids are row indices") from None
        if not 0 <= index < len(self) or str(key).strip() != str(index):
            raise KeyError(f"unknown record id {key!r}: the catalogue has ids 0..{len(self) - 1}")
        return index

    def inputs_only(self) -> Catalogue:
        """The same records without their labels (no ground truth, no attributes), so a damaged
        label fails no record: for runs that only time the model (`bench`'s performance mode)."""
        view = Catalogue(self._rows, self.source, None, self._image_root)
        view.has_labels = False
        return view

    def labels(self, scored: Iterable[int] | None = None) -> list[RecordLabels | None]:
        """Ground truth of every record, in order (no image is read).

        Raises `CatalogueError` naming the first record whose labels are missing
        or wrongly typed, among `scored` (default: every record). A record
        outside `scored` with unusable labels is None in the list.
        """
        labels = self._labels()
        for index in range(len(labels)) if scored is None else sorted(scored):
            if isinstance(labels[index], str):
                raise CatalogueError(f"{self.source}: record {index}: {labels[index]}")
        return [None if isinstance(label, str) else label for label in labels]

    def labels_or_none(self) -> list[RecordLabels | None]:
        """Like `labels`, with None for a record whose labels are unusable (to score the others)."""
        return self.labels(scored=())

    def _labels(self) -> list[RecordLabels | str]:
        if not self.has_labels:
            raise CatalogueError(
                f"{self.source}: has no ground truth columns ({', '.join(LABEL_COLUMNS)})"
            )
        names = (CANDIDATES, *LABEL_COLUMNS)
        attributes = self._attributes.all() if self._attributes is not None else itertools.repeat(None)
        labels: list[RecordLabels | str] = []
        # one copy of each category, candidate and brand string: records repeat them (a taxonomy's
        # few thousand categories), and a million records' labels otherwise held each line's own
        # copies, about 2.3 KB a record
        shared: dict[str, str] = {}
        rows = (dict(zip(names, values)) for columns in self._rows.column_slices(names)
                for values in zip(*(columns[name] for name in names)))
        for row, record_attributes in zip(rows, attributes):  # a row first: no attribute line is lost
            unreadable = next((value for value in row.values() if isinstance(value, Unreadable)), None)
            if unreadable is not None:
                labels.append(unreadable.reason)
                continue
            if isinstance(record_attributes, str):
                labels.append(record_attributes)
                continue
            try:
                truth = _checked_labels(row)
                candidates = _checked_candidates(row.get(CANDIDATES))
            except _RecordProblem as problem:
                labels.append(str(problem))
                continue
            labels.append(RecordLabels(
                category=shared.setdefault(truth.category, truth.category),
                brand=shared.setdefault(truth.brand, truth.brand),
                is_secondhand=truth.is_secondhand,
                candidates=[shared.setdefault(candidate, candidate) for candidate in candidates],
                attributes=record_attributes,
            ))
        if len(labels) != len(self):
            raise CatalogueError(f"{self.source}: {ATTRIBUTES_FILE} lost lines while it was read")
        return labels

    def check_images(self) -> None:
        """Check every image's header once; raise `CatalogueError` naming the first unusable one."""
        for item in self.items():
            if item.kind == "image":
                raise CatalogueError(f"{self.source}: record {item.index}: {item.error}")

    def _record(self, index: int, row: dict[str, Any] | str) -> ProductRecord:
        if isinstance(row, str):
            raise _RecordProblem("record", row)
        missing = [column for column in INPUT_COLUMNS if column not in row]
        if self.has_labels:
            missing += [column for column in LABEL_COLUMNS if column not in row]
        if missing:
            raise _RecordProblem("record", f"missing column(s) {', '.join(missing)}")
        title = _checked_text(row[TITLE], TITLE)
        description = _checked_text(row[DESCRIPTION], DESCRIPTION)
        candidates = _checked_candidates(row[CANDIDATES])
        ground_truth = _checked_labels(row) if self.has_labels else None
        attributes = None
        if self._attributes is not None:
            raw_attributes = self._attributes[index]
            if isinstance(raw_attributes, str):
                raise _RecordProblem("record", raw_attributes)
            try:
                attributes = ProductAttributes.model_validate(raw_attributes)
            except ValidationError as exc:
                raise _RecordProblem("record", f"{ATTRIBUTES_FILE}: {validation_problems(exc)}") from None
        image = _image_bytes(row[IMAGE], self._image_root)
        try:
            probe_image_bytes(image, max_pixels=DEFAULT_MAX_DECODE_PIXELS)
        except ImageDecodeError as exc:
            raise _RecordProblem("image", f"{IMAGE}: {exc}") from None
        try:
            return ProductRecord(
                id=str(index), title=title, description=description, image=image,
                candidate_categories=candidates, ground_truth=ground_truth, attributes=attributes,
            )
        except ValidationError as exc:
            raise _RecordProblem("record", validation_problems(exc)) from None


def _record_or_raise(item: CatalogueItem, source: str) -> ProductRecord:
    if item.record is None:
        raise CatalogueError(f"{source}: record {item.index}: {item.error}")
    return item.record


# ------------------------------------------------------------ per-record checks
def _describe(value: Any) -> str:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return f"{type(value).__name__} {shown}"


def _checked_text(value: Any, column: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _RecordProblem("record", f"{column}: expected a string, got {_describe(value)}")
    return _valid_unicode(value, column)


def _valid_unicode(text: str, where: str) -> str:
    """`text` unless it holds an unpaired surrogate: JSON's "\\ud800" escape reads as one, and it
    has no UTF-8 form, so no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _RecordProblem(
            "record", f"{where}: has an unpaired surrogate {text[exc.start]!r} at character {exc.start} "
            "(not valid Unicode)"
        ) from None
    return text


def _checked_candidates(value: Any) -> list[str]:
    if value is None:
        raise _RecordProblem("record", f"{CANDIDATES}: is null; expected a list of category strings")
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise _RecordProblem(
            "record", f"{CANDIDATES}: expected a list of category strings, got {_describe(value)}"
        )
    if not value:
        raise _RecordProblem("record", f"{CANDIDATES}: the candidate category list is empty")
    for position, candidate in enumerate(value):
        if not isinstance(candidate, str):
            raise _RecordProblem(
                "record", f"{CANDIDATES}: position {position} is {_describe(candidate)}, not a string"
            )
        if not candidate.strip():
            raise _RecordProblem("record", f"{CANDIDATES}: position {position} is blank")
        _valid_unicode(candidate, f"{CANDIDATES}: position {position}")
    return list(value)


def _checked_labels(row: dict[str, Any]) -> ProductMetadata:
    category, brand, secondhand = row.get(TRUE_CATEGORY), row.get(TRUE_BRAND), row.get(TRUE_SECONDHAND)
    for column, value in ((TRUE_CATEGORY, category), (TRUE_BRAND, brand)):
        if not isinstance(value, str):
            raise _RecordProblem("record", f"{column}: expected a string, got {_describe(value)}")
    if not isinstance(secondhand, bool):  # no coercion: "no" is not False (and not True)
        raise _RecordProblem("record", f"{TRUE_SECONDHAND}: expected a boolean, got {_describe(secondhand)}")
    return ProductMetadata(category=category, brand=brand, is_secondhand=secondhand)


def _image_bytes(value: Any, image_root: Path | None) -> bytes:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, dict):
        if value.get("bytes"):
            if not isinstance(value["bytes"], (bytes, bytearray)):
                raise _RecordProblem("image", f"{IMAGE}: bytes field is {_describe(value['bytes'])}")
            return bytes(value["bytes"])
        if value.get("path"):
            return _read_image_file(value["path"], image_root)
    if isinstance(value, str) and value:
        return _read_image_file(value, image_root)
    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.save(buffer, format=value.format or "PNG")
        return buffer.getvalue()
    if value is None or value == {} or (isinstance(value, dict) and not any(value.values())):
        raise _RecordProblem("image", f"{IMAGE}: the record has no image (null)")
    raise _RecordProblem("image", f"{IMAGE}: expected image bytes or a relative path, got {_describe(value)}")


def _read_image_file(name: Any, image_root: Path | None) -> bytes:
    """The bytes of an image file named by a path relative to the dataset's folder."""
    if not isinstance(name, str):
        raise _RecordProblem("image", f"{IMAGE}: path must be a string, got {_describe(name)}")
    if image_root is None:
        raise _RecordProblem("image", f"{IMAGE}: has a path ({name!r}) but no bytes, and this source reads no files")
    relative = Path(name)
    if relative.is_absolute():
        raise _RecordProblem("image", f"{IMAGE}: absolute path {name!r} refused; paths are relative to the dataset's folder")
    root = image_root.resolve()
    try:  # a NUL or a lone surrogate in the name, a name too long: before, they stopped the whole run
        target = (root / relative).resolve()
        inside, found = target.is_relative_to(root), target.is_file()
    except (OSError, ValueError) as exc:
        raise _RecordProblem("image", f"{IMAGE}: path {name!r} cannot name a file ({exc})") from None
    if not inside:
        raise _RecordProblem("image", f"{IMAGE}: path {name!r} leads outside the dataset's folder; refused")
    if not found:
        raise _RecordProblem("image", f"{IMAGE}: image file not found: {name!r}")
    size = target.stat().st_size
    if size > MAX_IMAGE_FILE_BYTES:
        raise _RecordProblem("image", f"{IMAGE}: image file {name!r} has {size} bytes, over the limit of {MAX_IMAGE_FILE_BYTES}")
    data = target.read_bytes()
    if is_lfs_pointer(data):
        raise _RecordProblem("image", f"{IMAGE}: {pointer_message(Path(name))}")
    return data


# ---------------------------------------------------------------------- loading
def load_catalogue(path: str | Path, split: str | None = None) -> Catalogue:
    """Load a catalogue from `path`; `split` selects splits, e.g. "test" or "train+test".

    Problems with the whole source (not found, not a catalogue, missing
    columns, no records) raise `CatalogueError`; problems with single records
    surface when they are read.
    """
    path = Path(path)
    if not path.exists():
        raise CatalogueError(f"catalogue not found: {path}{shipped_data_hint(path)}")
    if not path.is_file() and not path.is_dir():
        raise CatalogueError(
            f"{path}: is a pipe or a device; a catalogue is read more than once (indexed, then read "
            "by record), so write it to a file first"
        )
    path = _hub_cache_snapshot(path)
    if path.is_file() and path.suffix == ".jsonl":
        if split is not None:
            raise CatalogueError(f"{path}: a JSONL file has no splits; drop --split {split!r}")
        rows: _Rows = _JsonlRows(path)
        image_root = path.parent
    else:
        splits, image_root = _read_splits(path)
        chosen = _choose_splits(splits, split, path)
        try:
            rows = splits[chosen[0]] if len(chosen) == 1 else _ConcatRows([splits[name] for name in chosen])
        except CatalogueError as exc:
            raise CatalogueError(f"{path}: {', '.join(chosen)}: {exc}") from None
    if len(rows) == 0:
        raise CatalogueError(f"{path}: has no records")
    _check_columns(rows.column_names, path)
    attributes = None
    if path.is_dir():
        attributes = _read_attributes(path, len(rows))
        for extra in (ATTRIBUTES_FILE, MANIFEST_FILE):
            if (path / extra).is_file():
                rows.input_files.append(path / extra)
    return Catalogue(rows, source=str(path), attributes=attributes, image_root=image_root)


def _read_splits(path: Path) -> tuple[dict[str, _Rows], Path]:
    if path.is_file():
        if path.suffix != ".parquet":
            raise CatalogueError(
                f"{path}: expected a .parquet or .jsonl file, a catalogue directory or a `datasets` directory"
            )
        return {_split_of(path, path.parent) or "train": _ParquetRows([path])}, path.parent
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        import datasets

        datasets.disable_progress_bars()
        files = [file for file in path.rglob("*") if file.is_file()]
        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as exc:  # datasets raises many kinds for a damaged directory
            pointer = first_lfs_pointer(files)
            if pointer is not None:
                raise CatalogueError(pointer_message(pointer)) from None
            raise CatalogueError(f"{path}: cannot be read as a `datasets` directory ({exc})") from None
        if isinstance(loaded, datasets.DatasetDict):
            return {name: _DatasetRows(split, files) for name, split in loaded.items()}, path
        return {str(loaded.split) if loaded.split is not None else "train": _DatasetRows(loaded, files)}, path
    # not in hidden folders: a make-catalog run killed midway leaves its partial one there
    parquet_files = sorted(file for file in path.rglob("*.parquet")
                           if not any(part.startswith(".") for part in file.relative_to(path).parts))
    if not parquet_files:
        raise CatalogueError(f"{path}: holds no parquet files and no dataset saved by `datasets`")
    named = {file: _split_of(file, path) for file in parquet_files}
    unnamed = [file for file, split_name in named.items() if split_name is None]
    if unnamed and len(unnamed) < len(parquet_files):  # "train" for those would mix them in silently
        raise CatalogueError(
            f"{path}: cannot tell the split of {unnamed[0].relative_to(path)} while other files name theirs; "
            "name it <split>-00000-of-00001.parquet or put it in a <split>/ folder"
        )
    files_by_split: dict[str, list[Path]] = {}
    for file, split_name in named.items():
        files_by_split.setdefault(split_name or "train", []).append(file)  # no file names one: all "train"
    return {name: _ParquetRows(files) for name, files in files_by_split.items()}, path


def _split_of(file: Path, root: Path) -> str | None:
    """The split a parquet file belongs to: from its name (`_SPLIT_FROM_FILENAME`), or from a folder
    between it and `root` named like a split (the Hub's converted layout, "default/test/0000.parquet")."""
    match = _SPLIT_FROM_FILENAME.match(file.name)
    if match:
        return match.group("split")
    folders = file.relative_to(root).parts[:-1]
    return next((folder for folder in reversed(folders) if folder.lower() in SPLIT_ORDER), None)


def _hub_cache_snapshot(path: Path) -> Path:
    """For a Hugging Face cache folder (`datasets--owner--name`, with refs/ and snapshots/), the
    snapshot `refs/main` names: reading the whole folder would read every cached revision."""
    snapshots = path / "snapshots"
    if not (path.is_dir() and snapshots.is_dir() and (path / "refs").is_dir()):
        return path
    main = path / "refs" / "main"
    if main.is_file():
        revision = main.read_text(encoding="utf-8").strip()
        if (snapshots / revision).is_dir():
            return snapshots / revision
    revisions = sorted(folder.name for folder in snapshots.iterdir() if folder.is_dir())
    if len(revisions) == 1:
        return snapshots / revisions[0]
    if not revisions:
        raise CatalogueError(f"{path}: a Hugging Face cache folder with no snapshot")
    raise CatalogueError(
        f"{path}: a Hugging Face cache folder with {len(revisions)} snapshots and no refs/main naming one; "
        f"pass one snapshot folder, e.g. {snapshots / revisions[0]}"
    )


def _choose_splits(splits: dict[str, _Rows], requested: str | None, path: Path) -> list[str]:
    if requested is None:  # train, validation, test first (in any letter case), then the others by name
        def order(name: str) -> tuple[int, str]:
            lower = name.lower()
            return (SPLIT_ORDER.index(lower) if lower in SPLIT_ORDER else len(SPLIT_ORDER), name)

        return sorted(splits, key=order)
    chosen = [name.strip() for name in requested.split("+")]
    if "" in chosen:
        raise CatalogueError(f"--split {requested!r} has an empty split name; e.g. \"test\" or \"train+test\"")
    twice = sorted({name for name in chosen if chosen.count(name) > 1})
    if twice:
        raise CatalogueError(f"--split {requested!r} names {', '.join(twice)} twice (its records would repeat)")
    missing = [name for name in chosen if name not in splits]
    if missing:
        raise CatalogueError(
            f"{path}: no split {', '.join(missing)}; available: {', '.join(sorted(splits))}"
        )
    return chosen


def _check_columns(column_names: list[str], path: Path) -> None:
    missing = [column for column in INPUT_COLUMNS if column not in column_names]
    if missing:
        raise CatalogueError(
            f"{path}: missing column(s) {', '.join(missing)}; a catalogue needs "
            f"{', '.join(INPUT_COLUMNS)} (and {', '.join(LABEL_COLUMNS)} for evaluation)"
        )
    partial_labels = [column for column in LABEL_COLUMNS if column in column_names]
    if partial_labels and len(partial_labels) != len(LABEL_COLUMNS):
        absent = sorted(set(LABEL_COLUMNS) - set(partial_labels))
        raise CatalogueError(f"{path}: has some ground-truth columns but not {', '.join(absent)}")


class _AttributeLines:
    """`attributes.jsonl`, one JSON object per non-blank line in record order, read by byte offset
    (16 bytes a record held): read whole at start-up, it held about 1 KB a record for the whole
    run (1 GB per million records, in every Ray reader too), though only scoring reads it. A line
    that is not a JSON object is its record's problem, not the whole catalogue's."""

    def __init__(self, path: Path, num_rows: int) -> None:
        self.path = path
        self._offsets, self._numbers = array("Q"), array("Q")
        with path.open("rb") as handle:
            for line in read_lines(handle):
                if not line.is_blank:
                    self._offsets.append(line.offset)
                    self._numbers.append(line.number)
        if len(self._offsets) != num_rows:
            raise CatalogueError(f"{path}: has {len(self._offsets)} lines for {num_rows} records")

    def __getitem__(self, index: int) -> dict[str, Any] | str:
        """Record `index`'s attributes, or why its line is unusable."""
        with self.path.open("rb") as handle:
            handle.seek(self._offsets[index])
            line = next(read_lines(handle), None)
        if line is None:
            return f"{ATTRIBUTES_FILE}: line {self._numbers[index]}: gone (the file was cut short after it was opened)"
        return self._parsed(line, self._numbers[index])

    def all(self) -> Iterator[dict[str, Any] | str]:
        """Every record's, in order, in one pass."""
        with self.path.open("rb") as handle:
            lines = (line for line in read_lines(handle) if not line.is_blank)
            for line, number in zip(lines, self._numbers):
                yield self._parsed(line, number)

    def _parsed(self, line: JsonlLine, number: int) -> dict[str, Any] | str:
        parsed = _json_object(line)
        return f"{ATTRIBUTES_FILE}: line {number}: {parsed}" if isinstance(parsed, str) else parsed


def _read_attributes(path: Path, num_rows: int) -> _AttributeLines | None:
    attributes_path = path / ATTRIBUTES_FILE
    return _AttributeLines(attributes_path, num_rows) if attributes_path.is_file() else None
