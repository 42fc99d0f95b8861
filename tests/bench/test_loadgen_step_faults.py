"""The in-process SUT when an engine step raises, or adding a sample does: before, one failed
step failed every sample in the engine (13 of 64 blank answers from one passing fault), a dead
device made the engine thread step and log in a tight loop, and an unexpected error adding a
sample killed the engine thread, so LoadGen waited for ever."""

from __future__ import annotations

import json
import threading

import mlperf_loadgen as lg
import pytest

from schemas import ProductMetadata, ProductRecord
from tests.bench.test_loadgen_parts import CANDIDATES, jpeg
from vlm_catalog.bench.loadgen.qsl import CatalogueQSL
from vlm_catalog.bench.loadgen.report import ACCURACY_LOG_FILE
from vlm_catalog.bench.loadgen.requests import GREEDY, prepare_request
from vlm_catalog.bench.loadgen.responses import ResponseSink
from vlm_catalog.bench.loadgen.settings import RunOptions, build_log_settings, build_test_settings
from vlm_catalog.paths import DEFAULT_MODEL_DIR

COUNT = 8


@pytest.fixture(scope="module")
def engine():
    from vlm_catalog.engine.config import EngineConfig
    from vlm_catalog.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL_DIR, max_num_seqs=4))
    yield engine
    engine.close()


def records():
    return [ProductRecord(id=str(i), title=f"Desk lamp {i}", description="<p>A lamp</p>", image=jpeg(),
                          candidate_categories=CANDIDATES) for i in range(COUNT)]


def run(engine, out_dir, patch=None, timeout_s=120):
    """An Offline accuracy run over COUNT samples; {qsl_idx: answer} and the sink. `patch(sut)` runs
    before the test starts (it may wrap the engine's methods); the run must end within `timeout_s`."""
    from vlm_catalog.bench.loadgen.sut_engine import EngineSUT

    settings = build_test_settings(RunOptions("offline", "accuracy", count=COUNT), COUNT)
    sink = ResponseSink(report_first_tokens=False)
    with CatalogueQSL(records(), COUNT, COUNT, lambda product: prepare_request(product, "ours")) as qsl:
        with EngineSUT(engine, qsl, GREEDY, 40, sink) as sut:
            if patch is not None:
                patch(sut)
            runner = threading.Thread(target=lg.StartTestWithLogSettings,
                                      args=(sut.handle, qsl.handle, settings, build_log_settings(out_dir)), daemon=True)
            runner.start()
            runner.join(timeout_s)
            assert not runner.is_alive(), "LoadGen still waits on samples the SUT never completed"
    entries = json.loads((out_dir / ACCURACY_LOG_FILE).read_text())
    return {entry["qsl_idx"]: bytes.fromhex(entry["data"]).decode() for entry in entries}, sink


def failing_steps(engine, monkeypatch, fails):
    """`engine._run_step` raises where `fails(sample indices scheduled, call number)` says."""
    real, calls = engine._run_step, []
    state = {}

    def run_step(output, pending):
        calls.append(1)
        sut = state["sut"]
        indices = {sut._in_flight[chunk.request.request_id].index for chunk in output.chunks
                   if chunk.request.request_id in sut._in_flight}
        if output.chunks and fails(indices, len(calls)):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(output, pending)

    monkeypatch.setattr(engine, "_run_step", run_step)
    return lambda sut: state.update(sut=sut)


@pytest.fixture(scope="module")
def clean_answers(engine, tmp_path_factory):
    answers, sink = run(engine, tmp_path_factory.mktemp("clean"))
    assert sink.tally.failed == 0
    return answers


def test_a_passing_fault_costs_no_answer(engine, clean_answers, tmp_path, monkeypatch):
    answers, sink = run(engine, tmp_path, failing_steps(engine, monkeypatch, lambda indices, call: call == 3))
    assert sink.tally.failed == 0 and answers == clean_answers


def test_a_sample_that_fails_every_step_it_is_in_fails_alone(engine, clean_answers, tmp_path, monkeypatch):
    answers, sink = run(engine, tmp_path, failing_steps(engine, monkeypatch, lambda indices, call: 3 in indices))
    assert answers[3] == "" and sink.tally.failed == 1
    assert "sample 3: engine step failed: RuntimeError: CUDA error" in sink.tally.errors[0]
    assert {i: a for i, a in answers.items() if i != 3} == {i: a for i, a in clean_answers.items() if i != 3}
    assert all(ProductMetadata.model_validate_json(answers[i]).category in CANDIDATES for i in answers if i != 3)


def test_a_dead_device_fails_every_sample_soon_and_the_run_ends(engine, tmp_path, monkeypatch):
    answers, sink = run(engine, tmp_path, failing_steps(engine, monkeypatch, lambda indices, call: True), timeout_s=60)
    assert set(answers.values()) == {""} and sink.tally.failed == COUNT
    assert any("engine steps in a row failed" in error for error in sink.tally.errors)
    assert not engine.has_unfinished_requests()


def test_an_unexpected_error_adding_a_sample_fails_that_sample(engine, clean_answers, tmp_path, monkeypatch):
    real_add = engine.add_request

    def add_request(prompt, params, request_id):
        if "Desk lamp 5" in engine.tokenizer.decode(list(prompt.token_ids)):
            raise RuntimeError("the grammar compiler service is closed")
        return real_add(prompt, params, request_id=request_id)

    monkeypatch.setattr(engine, "add_request", add_request)
    answers, sink = run(engine, tmp_path, timeout_s=60)
    assert answers[5] == "" and sink.tally.failed == 1
    assert "sample 5: the grammar compiler service is closed" in sink.tally.errors[0]
    assert {i: a for i, a in answers.items() if i != 5} == {i: a for i, a in clean_answers.items() if i != 5}
