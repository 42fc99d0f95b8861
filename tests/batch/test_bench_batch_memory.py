"""scripts/bench_batch_memory.py: a small run with RSS sampling, and its per-tenth summary."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "bench_batch_memory.py"


def _script():
    spec = importlib.util.spec_from_file_location("bench_batch_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_highest_rss_per_tenth_buckets_by_answers_written():
    samples = [(1.0, 900.0, 0), (2.0, 1000.0, 3), (3.0, 950.0, 12), (4.0, 1200.0, 15), (5.0, 1100.0, 95), (6.0, 1150.0, 100)]
    assert _script().highest_rss_per_tenth(samples, 100) == [(0, 1000.0), (10, 1200.0), (90, 1150.0)]


def test_small_run_prints_peak_and_samples(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--sizes", "6", "--max-tokens", "4", "--workdir", str(tmp_path),
         "--sample-every-s", "0.2"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "     6 records (" in result.stdout and "peak RSS" in result.stdout
    assert "highest sampled RSS (MiB) by records written: 0+:" in result.stdout
    assert (tmp_path / "predictions-6.jsonl").read_text().count("\n") == 6
