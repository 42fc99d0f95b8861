"""The shipped data (default model, sample catalogue, taxonomy) where it is absent: an installed
package has no `data/` folder, and `VLM_CATALOG_DATA` says where a checkout's is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_cli(tmp_path: Path, data_dir: Path, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, VLM_CATALOG_DATA=str(data_dir))
    return subprocess.run([sys.executable, "-m", "vlm_catalog.cli", *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_missing_shipped_data_is_one_line_naming_the_fix(tmp_path):
    """Before: `--model .../data/models/...: not a checkpoint directory`, nothing on why or what to
    do; make-catalog ignored VLM_CATALOG_DATA and ended in a traceback."""
    nowhere = tmp_path / "nowhere"
    cases = {
        ("demo", "--limit", "1", "--out-dir", str(tmp_path / "demo")): "not a checkpoint directory",
        ("make-catalog", "--n", "2", "--out", str(tmp_path / "made")): "taxonomy file not found",
        ("eval", "--predictions", str(tmp_path / "p.jsonl"), "--dataset", str(nowhere / "sample_catalogue")):
            "catalogue not found",
    }
    (tmp_path / "p.jsonl").write_text('{"id": 0, "response": "{}"}\n')
    for argv, problem in cases.items():
        result = run_cli(tmp_path, nowhere, *argv)
        assert result.returncode in (1, 2) and result.stderr.count("\n") == 1, result.stderr
        assert problem in result.stderr and f"VLM_CATALOG_DATA={nowhere} has none" in result.stderr
    assert not (tmp_path / "demo").exists() and not (tmp_path / "made").exists()


def test_the_taxonomy_follows_vlm_catalog_data(tmp_path):
    from vlm_catalog.paths import DATA_DIR

    moved = tmp_path / "data"
    (moved / "taxonomy").mkdir(parents=True)
    original = (DATA_DIR / "taxonomy" / "shopify_categories_subset.txt").read_text(encoding="utf-8")
    (moved / "taxonomy" / "shopify_categories_subset.txt").write_text(original, encoding="utf-8")
    result = run_cli(tmp_path, moved, "make-catalog", "--n", "2", "--out", str(tmp_path / "made"))
    assert result.returncode == 0, result.stderr
    assert "wrote 2 rows" in result.stdout


def test_a_path_outside_the_shipped_data_gets_no_hint(tmp_path):
    from vlm_catalog.paths import shipped_data_hint

    assert shipped_data_hint(tmp_path / "my-model") == ""
