"""The shipped default model on held-out records, through our engine: catches regressions.

The records come from a generator seed that no training run used. The
thresholds sit below what the shipped model scores on them (see its model
card), with margin; a drop below them means the engine, the preprocessor or the
weights changed for the worse.
"""

from __future__ import annotations

from pathlib import Path

from vlm_catalog.data.synthetic import make_catalog
from vlm_catalog.paths import DEFAULT_MODEL_DIR
from vlm_catalog.training.heldout import evaluate_model

HELDOUT_SEED = 31337  # training used 1000 (tokenizer), 2000, 3000, 3100, 3200 (photos), 3300; held-out reports 9001, 52617, 70707
RECORDS = 32
MAX_MODEL_BYTES = 50 * 2**20

# The shipped model (run 8) scores 0.91 / 1.00 / 0.94 on these 32 records (run 7: 0.91 / 1.00
# / 0.88; run 5: 0.86 / 0.97 / 0.88; the model before 2026-11-23: 0.83 / 0.19 / 0.80); the
# thresholds leave room for ~3 different answers.
MIN_CATEGORY_HF1 = 0.85
MIN_BRAND_ACCURACY = 0.88
MIN_SECONDHAND_F1 = 0.80


def test_shipped_model_is_within_the_size_budget() -> None:
    size = sum(path.stat().st_size for path in DEFAULT_MODEL_DIR.iterdir() if path.is_file())
    assert size <= MAX_MODEL_BYTES


def test_shipped_model_answers_heldout_records(tmp_path: Path) -> None:
    catalogue = make_catalog(tmp_path / "heldout", n=RECORDS, seed=HELDOUT_SEED)
    report = evaluate_model(DEFAULT_MODEL_DIR, catalogue)
    assert report.num_samples == RECORDS
    assert report.num_unparsable == 0, report.unparsable_examples
    assert report.category_hf1 >= MIN_CATEGORY_HF1, report.format_table()
    assert report.brand_accuracy >= MIN_BRAND_ACCURACY, report.format_table()
    assert report.is_secondhand_f1 >= MIN_SECONDHAND_F1, report.format_table()



def test_rebuilding_the_default_model_never_replaces_a_folder_unasked(tmp_path: Path) -> None:
    """`make_default_model.py` writes random weights; with --out defaulting to the shipped folder, running
    the model card's first step as written once replaced the trained model."""
    from tests.scripts import run_script

    missing = run_script("make_default_model.py", timeout=120)
    assert missing.returncode == 2 and "--out" in missing.stderr  # no default: argparse's usage error
    existing = tmp_path / "model"
    existing.mkdir()
    (existing / "model.safetensors").write_bytes(b"trained")
    refused = run_script("make_default_model.py", "--out", str(existing), timeout=120)
    assert refused.returncode == 2 and refused.stderr == f"error: {existing} exists; pass --overwrite to replace it\n"
    assert (existing / "model.safetensors").read_bytes() == b"trained"
    shipped = run_script("make_default_model.py", "--out", str(DEFAULT_MODEL_DIR), timeout=120)
    assert shipped.returncode == 2 and "(the shipped, trained model) exists" in shipped.stderr
