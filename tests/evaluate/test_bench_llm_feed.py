"""scripts/bench_llm_feed.py: a short run reports the wait before the first step and the total."""

from __future__ import annotations

from tests.scripts import script_report


def test_short_run_reports_each_round(tmp_path):
    (run,) = script_report(
        "bench_llm_feed.py", tmp_path,
        "--records", "3", "--rounds", "1", "--max-tokens", "2", "--image-size", "small",
    )["runs"]
    assert run["records"] == 3 and run["failed"] == 0
    assert 0 < run["seconds_before_first_step"] < run["seconds"]
