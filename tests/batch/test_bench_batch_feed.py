"""scripts/bench_batch_feed.py: a small run of both feeding settings, end to end."""

from __future__ import annotations

from tests.scripts import script_report


def test_small_run_reports_both_settings_and_the_same_answers(tmp_path):
    report = script_report(
        "bench_batch_feed.py", tmp_path,
        "--records", "5", "--image-size", "small", "--max-tokens", "8", "--window", "2", "--read-ahead", "3",
        "--rounds", "1",
    )
    assert report["same_answers"] is True
    assert [run["read_ahead"] for run in report["runs"]] == [0, 3]
    for run in report["runs"]:
        assert run["records"] == 5 and run["failed"] == 0
        assert 0 < run["seconds_waiting_before_first_step"] <= run["seconds_waiting_for_records"] < run["seconds"]
        assert run["ms_waiting_per_record_after_first_step"] >= 0
