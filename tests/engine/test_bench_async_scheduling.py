"""scripts/bench_async_scheduling.py: both settings timed in turn, and their tokens compared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_async_scheduling.py"


def test_short_run_times_both_settings_and_finds_the_same_tokens(tmp_path):
    report_path = tmp_path / "async.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--records", "4", "--image-size", "small", "--max-tokens", "3", "--rounds", "1",
         "--json", str(report_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(report_path.read_text())
    assert report["same_tokens"] is True
    assert [row["async_scheduling"] for row in report["rows"]] == [False, True]
    assert all(row["generated_tokens"] == 4 * 3 and row["seconds"] > 0 for row in report["rows"])


def test_bad_arguments_are_named():
    result = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "0"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--rounds" in result.stderr
