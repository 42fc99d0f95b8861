"""One hostile row among good ones: it fails alone, with an error naming the problem."""

from __future__ import annotations

import io
import json

from PIL import Image

from tests.batch.conftest import FAST, jpeg, read_lines, sample_rows, write_parquet
from tests.conftest import png_bomb
from vlm_catalog.cli import main
from vlm_catalog.data.loader import load_catalogue


def jsonl_catalogue(folder):
    """A JSONL catalogue whose images are files next to it; one good record between each bad one."""
    images = folder / "images"
    images.mkdir(parents=True)
    good = sample_rows(1)[0]
    (images / "good.jpg").write_bytes(good["product_image"]["bytes"])
    (images / "empty.jpg").write_bytes(b"")
    (images / "text.jpg").write_text("just some text\n")
    (images / "page.jpg").write_text("<!DOCTYPE html><html><body>Not found</body></html>")
    (images / "logo.svg").write_text('<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>')
    (images / "cut.jpg").write_bytes(jpeg()[:12])
    (images / "bomb.png").write_bytes(png_bomb())
    thin = io.BytesIO()
    Image.new("RGB", (402, 2), "white").save(thin, "PNG")  # passes the loader's checks; the grid refuses it
    (images / "thin.png").write_bytes(thin.getvalue())
    (folder.parent / "secret.jpg").write_bytes(jpeg())
    base = {
        "title": good["product_title"], "description": good["product_description"],
        "candidates": good["potential_product_categories"], "category": good["ground_truth_category"],
        "brand": good["ground_truth_brand"], "is_secondhand": good["ground_truth_is_secondhand"],
    }
    bad = [  # (expected failure kind, words the error must contain, row changes)
        ("image", "null", {"image": None}),
        ("image", "empty", {"image": "images/empty.jpg"}),
        ("image", "is text", {"image": "images/text.jpg"}),
        ("image", "HTML", {"image": "images/page.jpg"}),
        ("image", "SVG", {"image": "images/logo.svg"}),
        ("image", "JPEG header", {"image": "images/cut.jpg"}),
        ("image", "pixels", {"image": "images/bomb.png"}),
        ("image", "absolute path", {"image": "/etc/passwd"}),
        ("image", "outside the dataset's folder", {"image": "../secret.jpg"}),
        ("image", "not found", {"image": "images/none.jpg"}),
        # before, an untagged ValueError from the engine: failure "engine", which --retry-failed engine retried
        ("image", "aspect ratio must be smaller than 200", {"image": "images/thin.png"}),
        ("record", "candidate category list is empty", {"candidates": []}),
        ("record", "position 1 is blank", {"candidates": ["A > B", "   "]}),
        ("record", "expected a list of category strings, got str", {"candidates": "A > B"}),
        ("record", "product_title: expected a string, got int 0", {"title": 0}),
        ("record", "ground_truth_is_secondhand: expected a boolean, got str 'no'", {"is_secondhand": "no"}),
        ("record", "missing column(s) product_description", {"description": ...}),
    ]
    lines, expected = [], {}
    for kind, words, change in bad:
        lines.append(json.dumps({**base, "image": "images/good.jpg"}))
        row = {**base, "image": "images/good.jpg", **change}
        lines.append(json.dumps({key: value for key, value in row.items() if value is not ...}))
        expected[str(len(lines) - 1)] = (kind, words)
    lines.append("{not json")
    expected[str(len(lines) - 1)] = ("record", "not JSON")
    lines.append(json.dumps({**base, "image": "images/good.jpg"}))
    path = folder / "records.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, expected


def test_each_bad_record_fails_alone_and_is_named(tmp_path, capsys):
    dataset, expected = jsonl_catalogue(tmp_path / "shop")
    out = tmp_path / "p.jsonl"
    assert main(["extract", "--dataset", str(dataset), "--out", str(out), "--eval", *FAST]) == 3
    printed = capsys.readouterr().out
    lines = {line["id"]: line for line in read_lines(out)}
    assert len(lines) == len(load_catalogue(dataset))
    for record_id, line in lines.items():
        if record_id in expected:
            kind, words = expected[record_id]
            assert line["failure"] == kind and line["finish_reason"] == "error", line
            assert words in line["error"], (words, line["error"])
        else:
            assert line["failure"] is None and line["parsed"] is not None, line
    assert "failed (image: 11, record: 7)" in printed
    assert "category hF1" in printed  # --eval scored what could be scored


def test_hostile_parquet_rows_fail_alone_and_llm_extract_survives_them(tmp_path):
    rows = sample_rows(6)
    rows[1]["product_image"] = None
    rows[2]["product_image"] = {"bytes": b"", "path": None}
    rows[3]["product_image"] = {"bytes": png_bomb(), "path": None}
    rows[4]["potential_product_categories"] = []
    dataset = write_parquet(tmp_path / "catalogue", rows)
    out = tmp_path / "p.jsonl"
    assert main(["extract", "--dataset", str(dataset), "--out", str(out), *FAST]) == 3
    failures = {line["id"]: line["failure"] for line in read_lines(out)}
    assert failures == {"0": None, "1": "image", "2": "image", "3": "image", "4": "record", "5": None}

    # the Python API: the bomb fails its record, not the call (no DecompressionBombError)
    from vlm_catalog import LLM, SamplingParams

    good = load_catalogue(dataset)[0]
    bomb = good.model_copy(update={"image": png_bomb()})
    llm = LLM()
    try:
        results = llm.extract([good, bomb], sampling_params=SamplingParams(max_tokens=40))
    finally:
        llm.engine.close()
    assert results[0].ok and not results[1].ok and "pixels" in results[1].error
