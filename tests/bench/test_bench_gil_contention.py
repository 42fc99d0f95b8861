"""scripts/bench_gil_contention.py: a short run reports every case."""

from __future__ import annotations

from tests.scripts import script_report


def test_short_run_reports_each_case(tmp_path):
    report = script_report(
        "bench_gil_contention.py", tmp_path,
        "--steps", "5", "--device-ms", "2", "--host-ms", "1", "--records", "2",
    )
    assert report["prepare_ms_per_prompt"] > 0
    steps = report["ms_per_step"]
    assert len(steps) == 4 and all(ms >= 3.0 for ms in steps.values())  # never below device + host
