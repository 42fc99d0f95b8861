"""Read model predictions for scoring.

Two formats:
- JSONL, one `{"id": ..., "response": "<raw model text>"}` per line, where `id` is
  the record id the catalogue loader assigned (the row index, as a string or int).
- MLPerf LoadGen's `mlperf_log_accuracy.json`: a JSON list of
  `{"seq_id": ..., "qsl_idx": <row index>, "data": "<hex of the UTF-8 response>", ...}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from io import BufferedReader
from pathlib import Path
from typing import BinaryIO

from vlm_catalog.data.jsonl import read_lines


class PredictionsError(ValueError):
    """A predictions file that cannot be read; the message names the file and the entry."""


@dataclass(frozen=True)
class Prediction:
    """One model answer. `key` is a record id (JSONL) or a row index (MLPerf log)."""

    key: str | int
    response: str


def read_predictions(path: str | Path) -> list[Prediction]:
    """Read a JSONL predictions file or an MLPerf accuracy log (detected from the content).

    The file is read once, from start to end, so a pipe works too
    (`--predictions <(cat part*.jsonl)`).
    """
    path = Path(path)
    if not path.exists():
        raise PredictionsError(f"predictions file not found: {path}")
    if path.is_dir():
        raise PredictionsError(f"{path} is a directory; give the predictions file")
    try:
        with path.open("rb") as handle:
            blank_lines, first = _skip_leading_whitespace(handle)
            if first == b"[":
                predictions = _parse_mlperf_log(handle.read(), path)
            else:
                predictions = _parse_jsonl(handle, path, first_line_number=blank_lines + 1)
    except OSError as exc:  # unreadable (permissions), or a read error of the disk
        raise PredictionsError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if not predictions:
        raise PredictionsError(f"{path}: holds no predictions")
    return predictions


def _skip_leading_whitespace(handle: BufferedReader) -> tuple[int, bytes]:
    """Consume the whitespace the file starts with: (the newlines in it, the first other byte, unread)."""
    newlines = 0
    while True:
        byte = handle.peek(1)[:1]
        if not byte or not byte.isspace():
            return newlines, byte
        newlines += byte == b"\n"
        handle.read(1)


def _parse_jsonl(handle: BinaryIO, path: Path, first_line_number: int) -> list[Prediction]:
    """Lines end only at b"\\n": a response may hold U+2028 or U+0085 unescaped."""
    predictions: list[Prediction] = []
    seen: set[str] = set()
    for line in read_lines(handle):
        if line.is_blank:
            continue
        where = f"{path}:{line.number + first_line_number - 1}"
        if line.raw is None:
            raise PredictionsError(f"{where}: {line.too_long_message()}")
        try:
            entry = json.loads(line.raw)
        except json.JSONDecodeError as exc:
            raise PredictionsError(f"{where}: not valid JSON ({exc.msg})") from None
        except UnicodeDecodeError as exc:
            raise PredictionsError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
        if not isinstance(entry, dict) or "id" not in entry or "response" not in entry:
            raise PredictionsError(f'{where}: expected an object with "id" and "response"')
        key, response = entry["id"], entry["response"]
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise PredictionsError(f'{where}: "id" must be a string or an integer')
        if not isinstance(response, str):
            raise PredictionsError(f'{where}: "response" must be a string')
        record = str(key).strip()  # the id as the catalogue reads it: 0, "0" and " 0" name one record
        if record in seen:
            raise PredictionsError(f"{where}: duplicate id {key!r} (an earlier line answers record {record!r})")
        seen.add(record)
        predictions.append(Prediction(key=key, response=response))
    return predictions


def _parse_mlperf_log(content: bytes, path: Path) -> list[Prediction]:
    try:
        entries = json.loads(content)
    except json.JSONDecodeError as exc:
        raise PredictionsError(f"{path}: not a valid MLPerf accuracy log ({exc.msg})") from None
    except UnicodeDecodeError as exc:
        raise PredictionsError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    predictions: list[Prediction] = []
    for position, entry in enumerate(entries):
        if not isinstance(entry, dict) or "qsl_idx" not in entry or "data" not in entry:
            raise PredictionsError(
                f'{path}: entry {position} needs "qsl_idx" and "data" (MLPerf accuracy log format)'
            )
        index = entry["qsl_idx"]
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise PredictionsError(f'{path}: entry {position}: "qsl_idx" must be an index >= 0')
        try:
            response = bytes.fromhex(entry["data"]).decode("utf-8")
        except (ValueError, TypeError) as exc:
            raise PredictionsError(f'{path}: entry {position}: "data" is not hex UTF-8 ({exc})') from None
        predictions.append(Prediction(key=index, response=response))
    return predictions


def write_predictions_jsonl(path: str | Path, predictions: list[Prediction]) -> None:
    """Write predictions in the JSONL format `read_predictions` reads."""
    with Path(path).open("w", encoding="utf-8") as handle:
        for prediction in predictions:
            handle.write(json.dumps({"id": prediction.key, "response": prediction.response}) + "\n")
