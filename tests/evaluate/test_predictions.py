"""Reading JSONL predictions and MLPerf accuracy logs, and their errors."""

import json
import os
import threading

import pytest

from vlm_catalog.data.jsonl import MAX_LINE_BYTES
from vlm_catalog.evaluate.predictions import (
    Prediction,
    PredictionsError,
    read_predictions,
    write_predictions_jsonl,
)


def test_jsonl_round_trip(tmp_path):
    path = tmp_path / "p.jsonl"
    predictions = [Prediction("0", '{"a": 1}'), Prediction(2, "not json ü")]
    write_predictions_jsonl(path, predictions)
    assert read_predictions(path) == predictions


def test_jsonl_lines_end_only_at_newline(tmp_path):
    """Our results file writes `ensure_ascii=False`, so a response may hold U+0085 or
    U+2028 raw; `str.splitlines` would cut its line in two."""
    path = tmp_path / "p.jsonl"
    responses = ['{"brand": "Caf\u00e9\x85"}', "a\u2028b\u2029c\x1cd"]
    path.write_text(
        "".join(json.dumps({"id": i, "response": r}, ensure_ascii=False) + "\n" for i, r in enumerate(responses)),
        encoding="utf-8",
    )
    assert read_predictions(path) == [Prediction(0, responses[0]), Prediction(1, responses[1])]


def test_an_oversized_or_non_utf8_line_is_named(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"id": 0, "response": "a"}\n' + b"[" * (MAX_LINE_BYTES + 1) + b"\n")
    with pytest.raises(PredictionsError, match=f"p.jsonl:2: the line has {MAX_LINE_BYTES + 2} bytes, over the limit"):
        read_predictions(path)
    path.write_bytes(b'{"id": 0, "response": "a"}\n{"id": 1, "response": "\xff"}\n')
    with pytest.raises(PredictionsError, match="p.jsonl:2: not UTF-8"):
        read_predictions(path)
    path.write_bytes(b"  \n[" + b'{"qsl_idx": 0, "data": "\xff"}]')
    with pytest.raises(PredictionsError, match="p.jsonl: not UTF-8"):
        read_predictions(path)


@pytest.mark.parametrize("kind", ["jsonl", "mlperf"])
def test_a_pipe_is_read_once_from_start_to_end(tmp_path, kind):
    """`--predictions <(cat part*.jsonl)` passes /dev/fd/N, a pipe: before, "not found"."""
    predictions = [Prediction(0, '{"a": 1}'), Prediction(1, "b")]
    if kind == "jsonl":
        content = b"\n \n" + "".join(
            json.dumps({"id": p.key, "response": p.response}) + "\n" for p in predictions).encode()
    else:
        content = b"  " + json.dumps(
            [{"qsl_idx": p.key, "data": p.response.encode().hex()} for p in predictions]).encode()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_bytes, args=(content,), daemon=True)  # no hang if the read fails
    writer.start()
    assert read_predictions(fifo) == predictions
    writer.join()


def test_line_numbers_count_the_blank_lines_the_file_starts_with(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('\n  \n {"id": 0, "response": "a"}\n{oops\n')
    with pytest.raises(PredictionsError, match="p.jsonl:4: not valid JSON"):
        read_predictions(path)
    with pytest.raises(PredictionsError, match="is a directory"):
        read_predictions(tmp_path)


def test_mlperf_accuracy_log_is_hex_decoded(tmp_path):
    path = tmp_path / "mlperf_log_accuracy.json"
    entries = [
        {"seq_id": 0, "qsl_idx": 2, "data": "héllo".encode().hex(), "token_count": 3},
        {"seq_id": 1, "qsl_idx": 0, "data": "", "token_count": 0},
    ]
    path.write_text(json.dumps(entries))
    assert read_predictions(path) == [Prediction(2, "héllo"), Prediction(0, "")]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"id": 1}\n', 'needs|expected an object with "id" and "response"'),
        ('{"id": 1, "response": "a"}\n{"id": "1", "response": "b"}\n', "duplicate id"),
        # the catalogue reads " 1" as record 1 too: before, both lines were scored
        ('{"id": 1, "response": "a"}\n{"id": " 1", "response": "b"}\n', r"duplicate id ' 1' \(an earlier line answers record '1'\)"),
        ("{not json\n", "not valid JSON"),
        ('{"id": 1.5, "response": "a"}\n', '"id" must be'),
        ('[{"qsl_idx": 0, "data": "zz"}]', "not hex"),
        ('[{"qsl_idx": -1, "data": ""}]', "qsl_idx"),
        ('[{"data": ""}]', "qsl_idx"),
        ("\n\n", "no predictions"),
    ],
)
def test_bad_files_name_the_problem(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(PredictionsError, match=message):
        read_predictions(path)


def test_missing_file(tmp_path):
    with pytest.raises(PredictionsError, match="not found"):
        read_predictions(tmp_path / "nope.jsonl")
