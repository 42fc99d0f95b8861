"""scripts/bench_gil_contention.py: a short run reports every case."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_gil_contention.py"


def test_short_run_reports_each_case(tmp_path):
    report_path = tmp_path / "gil.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "5", "--device-ms", "2", "--host-ms", "1", "--records", "2",
         "--json", str(report_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(report_path.read_text())
    assert report["prepare_ms_per_prompt"] > 0
    steps = report["ms_per_step"]
    assert len(steps) == 4 and all(ms >= 3.0 for ms in steps.values())  # never below device + host
