"""The synthetic catalogue generator: layout, determinism, and what the data looks like."""

from __future__ import annotations

import hashlib
import html
import io
import json
import os
import random
import re
import subprocess
import sys
import weakref
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from schemas import Condition, ProductAttributes
from vlm_catalog.cli import main
from vlm_catalog.data.synthetic import COLUMNS, CatalogueError, make_catalog, parquet_path
from vlm_catalog.data.synthetic.condition_cues import mentions_secondhand
from vlm_catalog.data.synthetic.images import (
    BENCHMARK_SIDES,
    COLOUR_RGB,
    pick_dimensions,
    render_product_image,
)
from vlm_catalog.data.synthetic.plan import plan_product
from vlm_catalog.data.synthetic.records import default_factory
from vlm_catalog.data.synthetic.signature import SignatureBook
from vlm_catalog.data.synthetic.vocabulary import BRAND_COUNT, brand_names, materials_for
from vlm_catalog.data.synthetic.wording import in_sentence
from vlm_catalog.data.taxonomy import load_taxonomy, split_path

SEED = 0
N = 40
RECORD_COUNT = 240  # records inspected in memory for statistics


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_catalog(tmp_path_factory.mktemp("catalogue"), n=N, seed=SEED)


@pytest.fixture(scope="module")
def records():
    factory = default_factory()
    return [factory.make(SEED, index) for index in range(RECORD_COUNT)]


def _rows(out_dir: Path, split: str = "test") -> list[dict]:
    return pq.read_table(parquet_path(out_dir, split)).to_pylist()


def _text(record) -> str:
    return html.unescape(f"{record.title}\n{record.description}")


# -- layout ---------------------------------------------------------------------------------


def test_layout_and_manifest(catalogue: Path) -> None:
    assert sorted(
        p.relative_to(catalogue).as_posix() for p in catalogue.rglob("*") if p.is_file()
    ) == [
        "attributes.jsonl",
        "catalogue.json",
        "data/test-00000-of-00001.parquet",
    ]
    manifest = json.loads((catalogue / "catalogue.json").read_text())
    assert manifest == {"generator": "vlm-catalog synthetic", "format_version": 1, "n": N,
                        "seed": SEED, "image_size": "small", "split": "test"}  # fmt: skip


def test_parquet_is_written_in_small_row_groups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vlm_catalog.data.synthetic import generator

    monkeypatch.setattr(generator, "ROWS_PER_ROW_GROUP", 3)
    out = make_catalog(tmp_path / "groups", n=7, seed=SEED)
    metadata = pq.ParquetFile(parquet_path(out, "test")).metadata
    assert [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)] == [3, 3, 1]
    assert [row["product_title"] for row in _rows(out)] == [default_factory().make(SEED, i).title for i in range(7)]


def test_records_are_made_and_written_a_chunk_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """All records in memory took about 55 kB each (55 GB for a million); now one chunk's. The
    file is the same records in the same row groups, and it loads as before. A run stopped
    midway leaves no half catalogue."""
    from vlm_catalog.data.loader import load_catalogue
    from vlm_catalog.data.synthetic import generator

    whole = make_catalog(tmp_path / "whole", n=20, seed=SEED)
    monkeypatch.setattr(generator, "RECORDS_PER_CHUNK", 4)
    made, most_alive = [], [0]
    real_make = default_factory().make
    factory = default_factory()

    def make(*args):
        most_alive[0] = max(most_alive[0], sum(record() is not None for record in made))
        record = real_make(*args)
        made.append(weakref.ref(record))
        return record

    monkeypatch.setattr(factory, "make", make)
    chunked = make_catalog(tmp_path / "chunked", n=20, seed=SEED, factory=factory)
    assert len(made) == 20 and most_alive[0] < 2 * 4  # two chunks at most; was 19, every record made so far
    assert _rows(chunked) == _rows(whole)
    assert (chunked / "attributes.jsonl").read_bytes() == (whole / "attributes.jsonl").read_bytes()
    assert pq.read_schema(parquet_path(chunked)).metadata == pq.read_schema(parquet_path(whole)).metadata
    assert [record.title for record in load_catalogue(chunked)] == [record.title for record in load_catalogue(whole)]

    def fail_at_six(seed, index, image_size):
        if index == 6:
            raise KeyboardInterrupt
        return real_make(seed, index, image_size)

    monkeypatch.setattr(factory, "make", fail_at_six)
    with pytest.raises(KeyboardInterrupt):
        make_catalog(tmp_path / "new" / "stopped", n=10, seed=SEED, factory=factory)
    assert not (tmp_path / "new").exists()  # nothing written, and the folders it made removed


@pytest.mark.parametrize("how", ["data_dir", "folder", "data_files"])
def test_loads_with_datasets(catalogue: Path, how: str) -> None:
    import datasets

    if how == "data_dir":
        loaded = datasets.load_dataset("parquet", data_dir=str(catalogue))
    elif how == "folder":
        loaded = datasets.load_dataset(str(catalogue))
    else:
        loaded = datasets.load_dataset("parquet", data_files=str(parquet_path(catalogue)))
    table = next(iter(loaded.values()))
    assert tuple(table.column_names) == COLUMNS
    assert len(table) == N
    features = table.features
    for name in (
        "product_title",
        "product_description",
        "ground_truth_category",
        "ground_truth_brand",
    ):
        assert features[name] == datasets.Value("string")
    assert features["ground_truth_is_secondhand"] == datasets.Value("bool")
    assert isinstance(features["product_image"], datasets.Image)
    assert features["potential_product_categories"] == datasets.List(datasets.Value("string"))
    image = table[0]["product_image"]
    assert isinstance(image, Image.Image) and image.format == "JPEG"
    assert min(image.size) >= 128 and max(image.size) <= 256


def test_images_are_stored_as_jpeg_bytes(catalogue: Path) -> None:
    for row in _rows(catalogue)[:5]:
        assert row["product_image"]["path"] is None
        assert row["product_image"]["bytes"][:3] == b"\xff\xd8\xff"


def test_attributes_file_matches_rows(catalogue: Path) -> None:
    lines = (catalogue / "attributes.jsonl").read_text().splitlines()
    rows = _rows(catalogue)
    assert len(lines) == len(rows) == N
    for line, row in zip(lines, rows, strict=True):
        attributes = ProductAttributes.model_validate_json(line)
        assert set(json.loads(line)) == {
            "colour",
            "material",
            "target_gender",
            "age_group",
            "condition",
        }
        assert (attributes.condition is not Condition.new) == row["ground_truth_is_secondhand"]


# -- determinism ----------------------------------------------------------------------------


def test_same_seed_same_catalogue_other_seed_different(catalogue: Path, tmp_path: Path) -> None:
    again = make_catalog(tmp_path / "again", n=N, seed=SEED)
    assert _rows(again) == _rows(catalogue)
    assert (again / "attributes.jsonl").read_bytes() == (
        catalogue / "attributes.jsonl"
    ).read_bytes()
    other = make_catalog(tmp_path / "other", n=N, seed=SEED + 1)
    other_rows, rows = _rows(other), _rows(catalogue)
    assert (
        sum(a["product_title"] != b["product_title"] for a, b in zip(other_rows, rows, strict=True))
        > N // 2
    )
    assert (
        sum(a["product_image"] != b["product_image"] for a, b in zip(other_rows, rows, strict=True))
        > N // 2
    )


def test_prefix_stable(catalogue: Path, tmp_path: Path) -> None:
    prefix = make_catalog(tmp_path / "prefix", n=12, seed=SEED)
    assert _rows(prefix) == _rows(catalogue)[:12]
    lines = (catalogue / "attributes.jsonl").read_text().splitlines()
    assert (prefix / "attributes.jsonl").read_text().splitlines() == lines[:12]


def test_records_do_not_depend_on_the_process_hash_seed(records) -> None:
    """Python salts str hashes per process; the generator must not notice."""
    script = (
        "import json, hashlib\n"
        "from vlm_catalog.data.synthetic.records import default_factory\n"
        "rows = [default_factory().make(0, i) for i in range(4)]\n"
        "print(json.dumps([[r.title, r.description, list(r.candidates),"
        " hashlib.sha256(r.image_jpeg).hexdigest()] for r in rows]))\n"
    )
    environment = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, check=True
    )
    expected = [
        [r.title, r.description, list(r.candidates), hashlib.sha256(r.image_jpeg).hexdigest()]
        for r in records[:4]
    ]
    assert json.loads(result.stdout) == expected


def test_small_and_realistic_share_labels_and_text(tmp_path: Path) -> None:
    realistic = make_catalog(tmp_path / "realistic", n=6, seed=SEED, image_size="realistic")
    small = make_catalog(tmp_path / "small", n=6, seed=SEED)
    for big, little in zip(_rows(realistic), _rows(small), strict=True):
        assert {k: v for k, v in big.items() if k != "product_image"} == {
            k: v for k, v in little.items() if k != "product_image"
        }
        width, height = Image.open(io.BytesIO(big["product_image"]["bytes"])).size
        assert width in BENCHMARK_SIDES and height in BENCHMARK_SIDES


# -- image sizes ----------------------------------------------------------------------------


def test_realistic_sizes_follow_the_benchmark() -> None:
    rng = random.Random(7)
    sizes = [pick_dimensions("realistic", rng) for _ in range(2000)]
    assert all(w in BENCHMARK_SIDES and h in BENCHMARK_SIDES for w, h in sizes)
    square = sum(w == h for w, h in sizes) / len(sizes)
    assert 0.8 <= square < 1.0  # mostly square, a few not
    assert {w for w, _ in sizes} == set(BENCHMARK_SIDES)


def test_small_sizes() -> None:
    rng = random.Random(7)
    for _ in range(200):
        width, height = pick_dimensions("small", rng)
        assert width == height and 128 <= width <= 256
    with pytest.raises(ValueError, match="unknown image_size 'huge'"):
        pick_dimensions("huge", rng)


# -- candidates -----------------------------------------------------------------------------


def test_candidate_lists(records) -> None:
    taxonomy = load_taxonomy()
    leaves = set(taxonomy.leaves())
    positions, counts = Counter(), Counter()
    for record in records:
        candidates = record.candidates
        assert len(candidates) in (8, 9)
        assert len(set(candidates)) == len(candidates)
        assert record.category in candidates and set(candidates) <= leaves
        positions[candidates.index(record.category)] += 1
        counts[len(candidates)] += 1
        related = set(taxonomy.siblings(record.category)) | set(taxonomy.cousins(record.category))
        if related & leaves:
            assert related & set(candidates), record.category
    assert set(counts) == {8, 9}
    assert len(positions) >= 8  # the truth moves around


# -- text -----------------------------------------------------------------------------------


def test_brand_is_in_the_title_or_description(records) -> None:
    only_in_description = 0
    for record in records:
        assert record.brand in record.title or record.brand in html.unescape(record.description)
        only_in_description += record.brand not in record.title
    assert 0.15 * len(records) <= only_in_description <= 0.6 * len(records)


def test_title_names_the_leaf_or_only_the_parent(records) -> None:
    explicit = generic = 0
    for record in records:
        levels = split_path(record.category)
        if levels[-1] in record.title:
            explicit += 1
        else:
            assert levels[-2] in record.title, record.title
            generic += 1
    assert explicit > 0.4 * len(records) and generic > 0.2 * len(records)


def test_descriptions_embed_markup_with_the_useful_text_inside(records) -> None:
    kinds = Counter()
    for record in records:
        description = record.description
        has_markup = bool(re.search(r"<(p|div|style|script)\b", description))
        kinds["markup" if has_markup else "plain"] += 1
        kinds.update(
            tag for tag in ("<script", "<style", "ld+json", "itemprop=") if tag in description
        )
        text = html.unescape(description).lower()
        levels = split_path(record.category)
        nouns = (in_sentence(levels[-1]).lower(), in_sentence(levels[-2]).lower())
        assert any(noun in text for noun in nouns), description
    assert kinds["markup"] >= 0.3 * len(records) and kinds["plain"] >= 0.3 * len(records)
    for tag in ("<script", "<style", "ld+json", "itemprop="):
        assert kinds[tag] > 0, tag


def test_secondhand_cues(records) -> None:
    secondhand = [r for r in records if r.is_secondhand]
    assert 0.15 <= len(secondhand) / len(records) <= 0.3
    for record in records:
        assert (record.attributes.condition is not Condition.new) == record.is_secondhand
        if not record.is_secondhand:
            assert not mentions_secondhand(_text(record)), record.title
    with_text_cue = [r for r in secondhand if mentions_secondhand(_text(r))]
    assert 0 < len(with_text_cue) < len(secondhand)  # some items show it only in the photo


def test_attributes_are_plausible_and_mentioned(records) -> None:
    colour_mentions = 0
    for record in records:
        attributes, text = record.attributes, _text(record).lower()
        assert attributes.material in materials_for(split_path(record.category)[0])
        assert attributes.material.value in html.unescape(record.description).lower()
        colour_mentions += attributes.colour.value in text or (
            attributes.colour.value == "grey" and "gray" in text
        )
        gender, age = attributes.target_gender.value, attributes.age_group.value
        audience_words = {
            "female": r"\bwomen\b|\bwomen's\b|\bgirls?'?|\bher\b",
            "male": r"\bmen\b|\bmen's\b|\bboys?'?",
            "kids": r"\bkids'?|\bgirls?'?|\bboys?'?",
            "baby": r"\bbab(y|ies)\b",
            "all ages": r"\ball ages\b",
        }
        for value in (gender, age):
            if value in audience_words:
                assert re.search(audience_words[value], text), (value, record.title)
    assert colour_mentions >= 0.6 * len(records)


def test_secondhand_rate_over_many_plans() -> None:
    taxonomy = load_taxonomy()
    rng = random.Random(3)
    plans = [plan_product(rng.choice(taxonomy.leaves()), rng) for _ in range(3000)]
    rate = sum(plan.is_secondhand for plan in plans) / len(plans)
    assert 0.15 <= rate <= 0.3
    food = [p for p in plans if p.top_level == "Food, Beverages & Tobacco"]
    assert food and not any(p.is_secondhand for p in food)


def test_brand_vocabulary() -> None:
    brands = brand_names()
    assert len(brands) == BRAND_COUNT == len({b.lower() for b in brands})
    assert brands == brand_names.__wrapped__()  # deterministic
    assert not any(mentions_secondhand(b) for b in brands)
    assert sum(b[:1].isupper() and not b.isupper() for b in brands) > 0.8 * len(brands)


# -- images ---------------------------------------------------------------------------------


def test_visual_signatures_separate_siblings_and_cousins() -> None:
    taxonomy = load_taxonomy()
    book = SignatureBook(taxonomy)
    leaves = taxonomy.leaves()
    assert len({book[leaf] for leaf in leaves}) == len(leaves)  # unique per leaf
    for leaf in leaves:
        mine = book[leaf]
        for sibling in taxonomy.siblings(leaf):
            assert book[sibling].shape == mine.shape and book[sibling].glyph != mine.glyph
        for cousin in (c for c in taxonomy.cousins(leaf) if taxonomy.is_leaf(c)):
            assert book[cousin].shape != mine.shape
    assert len(book) == len(leaves)
    rebuilt = SignatureBook(taxonomy)  # depends on the taxonomy only
    assert all(book[leaf] == rebuilt[leaf] for leaf in leaves)


def test_image_shows_the_product_colour(records) -> None:
    """Among the palette colours, the product's colour covers the most pixels."""
    book = SignatureBook(load_taxonomy())
    palette = list(COLOUR_RGB)
    for record in records[:60]:
        image = Image.open(io.BytesIO(record.image_jpeg)).convert("RGB")
        pixels = np.asarray(image.resize((64, 64), Image.Resampling.NEAREST), dtype=float)
        tint = np.array(book[record.category].backdrop_tint, dtype=float)
        backdrop_shades = [tint * factor for factor in (1.0, 0.93, 0.9, 0.85, 0.8)]
        references = np.array([COLOUR_RGB[c] for c in palette] + backdrop_shades)  # [C, 3]
        nearest = np.linalg.norm(pixels[..., None, :] - references, axis=-1).argmin(axis=-1)
        counts = np.bincount(nearest.ravel(), minlength=len(references))[: len(palette)]
        colour = record.attributes.colour
        assert palette[int(counts.argmax())] is colour, (record.category, colour)
        assert counts[palette.index(colour)] > 0.1 * nearest.size


def test_the_glyph_is_what_tells_siblings_apart() -> None:
    taxonomy = load_taxonomy()
    book = SignatureBook(taxonomy)
    leaf = next(p for p in taxonomy.leaves() if taxonomy.siblings(p))
    sibling = taxonomy.siblings(leaf)[0]
    colour = next(iter(COLOUR_RGB))

    def draw(category: str) -> np.ndarray:
        image = render_product_image(book[category], colour, 160, 160, random.Random(1))
        return np.asarray(image, dtype=int)

    assert np.array_equal(draw(leaf), draw(leaf))
    assert not np.array_equal(draw(leaf), draw(sibling))


# -- errors and the command line --------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be a positive integer"),
        ({"n": True}, "n must be a positive integer"),
        ({"n": 2, "image_size": "huge"}, "unknown image_size 'huge'"),
        ({"n": 2, "split": "a/b"}, "split must be a name"),
        ({"n": 2, "seed": "1"}, "seed must be an integer"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict, message: str) -> None:
    arguments = {"seed": 0, **kwargs}
    with pytest.raises(CatalogueError, match=message):
        make_catalog(tmp_path / "out", **arguments)
    assert not (tmp_path / "out").exists()


def test_existing_catalogue_needs_overwrite(tmp_path: Path) -> None:
    out = make_catalog(tmp_path / "out", n=2, seed=0)
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(CatalogueError, match="already holds a catalogue"):
        make_catalog(out, n=3, seed=1)
    make_catalog(out, n=3, seed=1, split="train", overwrite=True)
    assert (out / "notes.txt").read_text() == "keep me"
    assert [p.name for p in (out / "data").iterdir()] == ["train-00000-of-00001.parquet"]
    assert json.loads((out / "catalogue.json").read_text())["n"] == 3
    (tmp_path / "file").write_text("")
    with pytest.raises(CatalogueError, match="not a directory"):
        make_catalog(tmp_path / "file", n=1, seed=0)


def test_an_overwrite_stopped_midway_keeps_the_old_catalogue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`--overwrite` deleted the old catalogue before writing the new one: Ctrl-C or SIGTERM midway
    left neither (SIGTERM also a 23 MB parquet file that did not load). Now the new one is written
    beside it, out of sight, and renamed into place once whole."""
    import os
    import signal

    out = make_catalog(tmp_path / "out", n=4, seed=0)
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    factory = default_factory()
    real_make = factory.make

    def stop_at(signum):
        def make(seed, index, image_size):
            if index == 2:
                os.kill(os.getpid(), signum)
            return real_make(seed, index, image_size)
        return make

    for signum in (signal.SIGINT, signal.SIGTERM):
        monkeypatch.setattr(factory, "make", stop_at(signum))
        assert main(["make-catalog", "--n", "6", "--seed", "1", "--out", str(out), "--overwrite"]) == 130
        assert capsys.readouterr().err == (f"error: interrupted; nothing was written to {out} "
                                           "(a catalogue already there is kept)\n")
        assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before
        assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]  # no staging folder left
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))


def test_the_catalogue_is_built_inside_out_and_a_killed_runs_leftover_is_not_read(tmp_path: Path) -> None:
    """Built beside --out, a catalogue could not go to an --out on another file system than its parent
    (a link: "Invalid cross-device link"), nor to a writable mount point in a read-only folder. It is
    built in a hidden folder inside --out now, which the loader skips (a run killed by SIGKILL leaves it)."""
    from vlm_catalog.data.loader import load_catalogue

    target = make_catalog(tmp_path / "target", n=2, seed=0)
    link = tmp_path / "link"
    link.symlink_to(target)
    make_catalog(link, n=3, seed=1, overwrite=True)
    assert link.is_symlink() and len(_rows(target)) == 3
    leftover = target / ".make-catalog.abc123.partial"
    make_catalog(leftover, n=4, seed=2)  # as a killed run leaves its staging folder
    assert len(load_catalogue(target)) == 3


def test_an_output_folder_that_cannot_be_written_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    def refused(*args, **kwargs):  # root writes anywhere, so the refusal is simulated
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", refused)
    assert main(["make-catalog", "--n", "2", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err == f"error: cannot write {tmp_path / 'x'}: Permission denied\n"


def test_cli_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert main(["make-catalog", "--n", "5", "--seed", "3", "--out", str(out)]) == 0
    summary = capsys.readouterr().out.strip()
    assert "5 rows" in summary and str(out) in summary and " s" in summary
    assert len(summary.splitlines()) == 1
    assert json.loads((out / "catalogue.json").read_text())["seed"] == 3
    assert len(_rows(out)) == 5

    assert main(["make-catalog", "--n", "5", "--out", str(out)]) == 2
    assert "error: " in capsys.readouterr().err
    assert main(["make-catalog", "--n", "5", "--out", str(out), "--overwrite",
                 "--split", "train"]) == 0  # fmt: skip


def test_cli_rejects_unknown_image_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["make-catalog", "--n", "2", "--out", str(tmp_path / "x"), "--image-size", "huge"])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.startswith("error: unknown image_size 'huge'")
    assert "Traceback" not in captured.err
    assert not (tmp_path / "x").exists()
