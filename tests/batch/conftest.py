"""Batch-job fixtures: small catalogues cut from the shipped sample, hostile rows, a reference run."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from vlm_catalog.paths import SAMPLE_CATALOGUE_DIR

SAMPLE_PARQUET = SAMPLE_CATALOGUE_DIR / "data" / "test-00000-of-00001.parquet"
# A budget above the tight threshold: the plain per-record schema, as at the default 150.
FAST = ["--max-tokens", "80"]


def sample_rows(count: int) -> list[dict]:
    return pq.read_table(SAMPLE_PARQUET).slice(0, count).to_pylist()


def write_parquet(directory: Path, rows: list[dict], schema: pa.Schema | None = None, row_group_size: int = 4) -> Path:
    (directory / "data").mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=schema or pq.read_schema(SAMPLE_PARQUET).remove_metadata())
    pq.write_table(table, directory / "data" / "test-00000-of-00001.parquet", row_group_size=row_group_size)
    return directory


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def answers(path: Path) -> dict[str, str]:
    return {line["id"]: line["response"] for line in read_lines(path)}


def jpeg(colour=(200, 40, 40), size=(64, 48)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="JPEG")
    return buffer.getvalue()


@pytest.fixture(scope="session")
def small_catalogue(tmp_path_factory) -> Path:
    """12 records of the shipped sample as parquet, 4 rows per row group."""
    return write_parquet(tmp_path_factory.mktemp("small") / "catalogue", sample_rows(12))


@pytest.fixture(scope="session")
def reference_answers(small_catalogue, tmp_path_factory) -> dict[str, str]:
    """An uninterrupted single-process run over the small catalogue."""
    from vlm_catalog.cli import main

    out = tmp_path_factory.mktemp("reference") / "predictions.jsonl"
    assert main(["extract", "--dataset", str(small_catalogue), "--out", str(out), *FAST]) == 0
    return answers(out)
