"""An engine step that raises during `vlm-catalog extract`: a one-off fault, a record whose request
fails every step it is in, and a dead device (every step fails). Before, each ended the job with a
traceback, and a record that failed every time stopped every resume at the same place."""

from __future__ import annotations

import pytest

from tests.batch.conftest import FAST, read_lines
from vlm_catalog.batch.output import JOB_SUFFIX
from vlm_catalog.cli import main
from vlm_catalog.engine.llm_engine import LLMEngine


def extract(dataset, out, *extra) -> int:
    return main(["extract", "--dataset", str(dataset), "--out", str(out), *FAST, *extra])


def failing_steps(monkeypatch, fails) -> list[int]:
    """Make `LLMEngine.step` raise where `fails(call number, request ids scheduled)` says; the calls made."""
    real = LLMEngine._run_step
    calls = []

    def run_step(self, output, pending):
        calls.append(len(calls))
        scheduled = {chunk.request.request_id for chunk in output.chunks}
        if fails(len(calls), scheduled):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(self, output, pending)

    monkeypatch.setattr(LLMEngine, "_run_step", run_step)
    return calls


def test_a_one_off_step_fault_reruns_its_records_and_changes_no_answer(small_catalogue, reference_answers, tmp_path,
                                                                       monkeypatch, capsys):
    failing_steps(monkeypatch, lambda call, scheduled: call == 3)
    out = tmp_path / "p.jsonl"
    assert extract(small_catalogue, out) == 0
    lines = {line["id"]: line for line in read_lines(out)}
    assert sorted(lines, key=int) == [str(i) for i in range(12)] and all(line["failure"] is None for line in lines.values())
    assert {i: line["response"] for i, line in lines.items()} == reference_answers


@pytest.mark.parametrize("poison", ["5", "11"])  # 11 runs alone last: a one-token probe shows the engine works
def test_a_record_that_fails_every_step_is_that_records_failure_alone(small_catalogue, reference_answers, tmp_path,
                                                                       monkeypatch, poison):
    failing_steps(monkeypatch, lambda call, scheduled: f"batch-{poison}" in scheduled)
    out = tmp_path / "p.jsonl"
    assert extract(small_catalogue, out) == 3  # some records failed
    lines = {line["id"]: line for line in read_lines(out)}
    assert sorted(lines, key=int) == [str(i) for i in range(12)]
    assert lines[poison]["failure"] == "engine"
    assert lines[poison]["error"] == "internal engine error: RuntimeError: CUDA error: an illegal memory access was encountered"
    assert {i: line["response"] for i, line in lines.items() if i != poison} == {
        i: answer for i, answer in reference_answers.items() if i != poison}


def test_a_dead_device_stops_the_run_in_one_line_and_fails_no_record(small_catalogue, reference_answers, tmp_path,
                                                                      monkeypatch, capsys):
    """Every step fails from the third on: each record run alone fails too, and none may be written
    as failed for it (a million `engine` failures); the run stops, and resumes once the device works."""
    dead = failing_steps(monkeypatch, lambda call, scheduled: call >= 3)
    out = tmp_path / "p.jsonl"
    capsys.readouterr()
    assert extract(small_catalogue, out) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    error = errors[0]
    assert "the run stopped: 16 engine steps in a row failed, the last with RuntimeError: CUDA error" in error
    assert "the same command resumes" in error
    assert all(line["failure"] is None for line in read_lines(out)) and len(dead) >= 16
    assert out.with_name(out.name + JOB_SUFFIX).exists()
    monkeypatch.undo()
    assert extract(small_catalogue, out) == 0
    assert {line["id"]: line["response"] for line in read_lines(out)} == reference_answers


@pytest.mark.parametrize("max_in_a_row", [0, -1])
def test_the_limit_is_at_least_one(max_in_a_row):
    from vlm_catalog.engine.step_faults import StepFaults

    with pytest.raises(ValueError, match="max_in_a_row must be at least 1"):
        StepFaults(None, max_in_a_row)


def test_a_step_with_nothing_to_run_confirms_nothing():
    """A step that ran no work (every request waiting for its grammar) counted as a success: on a
    dead device it reset the count of failed steps and released the held failures, so a large
    window wrote most of its records as `engine` failures instead of stopping (135 of 150)."""
    from types import SimpleNamespace

    from vlm_catalog.engine.step_faults import EngineFailing, StepFaults

    class DeadDevice:
        def __init__(self):
            self.stats = SimpleNamespace(num_sampled_tokens=0)
            self.calls = 0

        def step(self):
            self.calls += 1
            if self.calls % 2:  # every other step has nothing to run: it "succeeds"
                return []
            raise RuntimeError("CUDA error: unspecified launch failure")

        def abort_all(self):
            return ["batch-0"]

    faults = StepFaults(DeadDevice(), max_in_a_row=3)
    assert faults.step().dropped == [] and faults.confirmed  # nothing failed yet
    assert faults.step().dropped == ["batch-0"] and not faults.confirmed
    assert faults.step().outputs == [] and not faults.confirmed  # the empty step shows nothing
    faults.step()
    faults.step()
    with pytest.raises(EngineFailing, match="3 engine steps in a row failed"):
        faults.step()
