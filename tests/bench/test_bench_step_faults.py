"""scripts/bench_step_faults.py: a short run reports both runs, and only the poisoned record fails."""

from __future__ import annotations

import pytest

from tests.scripts import script_report


@pytest.mark.slow  # two extract runs in a subprocess, each loading the model: about 20 s
def test_short_run_reports_the_clean_and_the_poisoned_run(tmp_path):
    report = script_report("bench_step_faults.py", tmp_path, "--limit", "6", "--poison", "5", "--max-tokens", "4")
    clean, poisoned = report["clean"], report["poisoned"]
    assert clean["records"] == poisoned["records"] == 6
    assert clean["failed_steps"] == 0 and clean["failed_records"] == [] and clean["exit_status"] == 0
    assert poisoned["failed_records"] == [5] and poisoned["failed_steps"] >= 2  # alone, twice
    assert poisoned["steps"] > clean["steps"]
