"""scripts/bench_sampler.py: a short run times every setting at every batch size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_sampler.py"


def test_short_run_reports_each_setting(tmp_path):
    report_path = tmp_path / "sampler.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--batches", "1", "3", "--vocab", "500", "--repeats", "1",
         "--json", str(report_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(report_path.read_text())
    assert report["vocab"] == 500
    assert set(report["ms_per_call"]) == {"1", "3"}
    for timings in report["ms_per_call"].values():
        assert set(timings) == {"greedy", "generation_config", "top_p", "temperature"}
        assert all(ms > 0 for ms in timings.values())


def test_bad_arguments_are_named():
    result = subprocess.run([sys.executable, str(SCRIPT), "--batches", "0"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--batches" in result.stderr
