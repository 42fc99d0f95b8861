"""scripts/bench_async_scheduling.py: both settings timed in turn, and their tokens compared."""

from __future__ import annotations

from tests.scripts import run_script, script_report


def test_short_run_times_both_settings_and_finds_the_same_tokens(tmp_path):
    report = script_report(
        "bench_async_scheduling.py", tmp_path,
        "--records", "4", "--image-size", "small", "--max-tokens", "3", "--rounds", "1",
    )
    assert report["same_tokens"] is True
    assert [row["async_scheduling"] for row in report["rows"]] == [False, True]
    assert all(row["generated_tokens"] == 4 * 3 and row["seconds"] > 0 for row in report["rows"])


def test_bad_arguments_are_named():
    result = run_script("bench_async_scheduling.py", "--rounds", "0", timeout=60)
    assert result.returncode == 2 and "--rounds" in result.stderr
