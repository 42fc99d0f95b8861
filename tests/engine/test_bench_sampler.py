"""scripts/bench_sampler.py: a short run times every setting at every batch size."""

from __future__ import annotations

from tests.scripts import run_script, script_report


def test_short_run_reports_each_setting(tmp_path):
    report = script_report(
        "bench_sampler.py", tmp_path,
        "--device", "cpu", "--batches", "1", "3", "--vocab", "500", "--repeats", "1", timeout=120,
    )
    assert report["vocab"] == 500
    assert set(report["ms_per_call"]) == {"1", "3"}
    for timings in report["ms_per_call"].values():
        assert set(timings) == {"greedy", "generation_config", "top_p", "temperature"}
        assert all(ms > 0 for ms in timings.values())


def test_bad_arguments_are_named():
    result = run_script("bench_sampler.py", "--batches", "0", timeout=60)
    assert result.returncode == 2 and "--batches" in result.stderr
