"""scripts/bench_llm_feed.py: a short run reports the wait before the first step and the total."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_llm_feed.py"


def test_short_run_reports_each_round(tmp_path):
    report_path = tmp_path / "feed.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--records", "3", "--rounds", "1", "--max-tokens", "2", "--image-size", "small",
         "--json", str(report_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (run,) = json.loads(report_path.read_text())["runs"]
    assert run["records"] == 3 and run["failed"] == 0
    assert 0 < run["seconds_before_first_step"] < run["seconds"]
