"""`FailedStepRetries` on an engine that fails the steps a poisoned request is in: the bisection
that finds it, the count of failed steps that tells a dead device from bad requests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vlm_catalog.engine.outputs import RequestOutput
from vlm_catalog.engine.step_faults import (
    MAX_FAILED_STEPS_IN_A_ROW,
    EngineFailing,
    FailedStepRetries,
)


class PoisonEngine:
    """Every request finishes in the step after it is added; a step with a poisoned request in it
    (or every step, when `dead`) raises. `groups` records who ran together in each step."""

    def __init__(self, poisoned=(), dead=False):
        self.poisoned = set(poisoned)
        self.dead = dead
        self.requests: list[str] = []
        self.groups: list[list[str]] = []
        self.stats = SimpleNamespace(num_sampled_tokens=0)

    def add_request(self, prompt, params, request_id):
        self.requests.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        if not self.requests:
            return []
        self.groups.append(list(self.requests))
        if self.dead or self.poisoned & set(self.requests):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        finished, self.requests = self.requests, []
        self.stats.num_sampled_tokens += len(finished)
        return [RequestOutput(request_id, "", [1], 1, True, "stop") for request_id in finished]

    def abort_all(self):
        dropped, self.requests = self.requests, []
        return dropped


def drive(engine, keys):
    """The drivers' loop (`LLM._run_alone`, the batch job's `feed`): all keys at once, then the
    retries' groups; {key: "ok" or its error} and the failed steps."""
    retries: FailedStepRetries[str] = FailedStepRetries(engine)
    results: dict[str, str] = {}
    queue = list(keys)
    while True:
        for key in retries.next_group(idle=not engine.has_unfinished_requests()):
            engine.add_request(None, None, key)
        if not retries.isolating:
            while queue:
                engine.add_request(None, None, queue.pop(0))
        if not engine.has_unfinished_requests():
            if not retries.suspects_left:
                results.update(retries.confirmed_failures(finished=True))
                return results, retries.faults.failed_steps
            continue
        result = retries.step()
        if result.error is not None:
            retries.dropped([key for key in result.dropped if key in keys])
        results.update(retries.confirmed_failures())
        results.update((output.request_id, "ok") for output in result.outputs if output.request_id in keys)


KEYS = [f"r{i}" for i in range(16)]


def test_a_poisoned_request_is_found_by_halving_its_group():
    engine = PoisonEngine(poisoned={"r11"})
    results, failed_steps = drive(engine, KEYS)
    assert results == {key: "ok" for key in KEYS} | {"r11": "RuntimeError: CUDA error: an illegal memory access was encountered"}
    assert [len(group) for group in engine.groups] == [16, 8, 8, 4, 2, 2, 1, 1, 1, 4]  # r12..r15 confirm r11's
    assert engine.groups[1] == KEYS[:8] and engine.groups[2] == KEYS[8:] and engine.groups[7:9] == [["r11"]] * 2
    assert failed_steps == 6  # all 16, then r8..r15, r8..r11, r10 r11, r11 alone twice


def test_a_one_off_fault_reruns_the_step_in_two_halves():
    engine = PoisonEngine()
    real_step, calls = engine.step, []

    def once_failing():
        calls.append(1)
        if len(calls) == 1:
            engine.groups.append(list(engine.requests))
            raise RuntimeError("CUDA error: out of memory")
        return real_step()

    engine.step = once_failing
    results, failed_steps = drive(engine, KEYS)
    assert results == {key: "ok" for key in KEYS} and failed_steps == 1
    assert engine.groups == [KEYS, KEYS[:8], KEYS[8:]]


def test_a_passing_fault_that_hits_a_request_running_alone_does_not_fail_it():
    """r4, innocent, runs alone (its group held the poisoned r5) and a passing fault hits that run:
    before, a request ran alone once, and that fault was blamed on it."""
    engine = PoisonEngine(poisoned={"r5"})
    real_step = engine.step

    def also_fails_r4_alone_once():
        if engine.requests == ["r4"] and not hasattr(engine, "hit"):
            engine.hit = True
            engine.groups.append(["r4"])
            raise RuntimeError("CUDA error: out of memory")
        return real_step()

    engine.step = also_fails_r4_alone_once
    keys = [f"r{i}" for i in range(8)]
    results, _ = drive(engine, keys)
    assert engine.hit and {key for key, outcome in results.items() if outcome != "ok"} == {"r5"}


def test_a_run_of_bad_requests_is_not_a_dead_device():
    """Halving a failing group is not evidence the device is dead: only the first failure and those of
    requests alone count towards `EngineFailing`, so with halving 12 bad requests in a row of 256 fail alone,
    as one at a time they did, instead of stopping the driver."""
    keys = [f"r{i}" for i in range(256)]
    poisoned = set(keys[100:112])
    results, _ = drive(PoisonEngine(poisoned=poisoned), keys)
    assert {key for key, outcome in results.items() if outcome != "ok"} == poisoned and len(results) == 256


def test_a_dead_device_raises_engine_failing_soon_and_confirms_no_failure():
    engine = PoisonEngine(dead=True)
    with pytest.raises(EngineFailing, match=f"{MAX_FAILED_STEPS_IN_A_ROW} engine steps in a row failed"):
        drive(engine, [f"r{i}" for i in range(256)])
    assert len(engine.groups) < 4 * MAX_FAILED_STEPS_IN_A_ROW


def test_abandon_gives_back_every_suspect_and_held_failure():
    engine = PoisonEngine(poisoned={"r0", "r1"})
    retries: FailedStepRetries[str] = FailedStepRetries(engine)
    for key in KEYS[:4]:
        engine.add_request(None, None, key)
    retries.dropped(retries.step().dropped)  # r0..r3 fail together: halves r0 r1, r2 r3
    for key in retries.next_group(idle=True):
        engine.add_request(None, None, key)
    retries.dropped(retries.step().dropped)  # r0 r1 fail: halves r0, r1
    for key in retries.next_group(idle=True):
        engine.add_request(None, None, key)
    retries.dropped(retries.step().dropped)  # r0 fails alone: held
    assert retries.confirmed_failures() == []  # nothing has succeeded since
    abandoned = retries.abandon()
    assert sorted(key for key, _ in abandoned) == ["r0", "r1", "r2", "r3"]
    assert {error for _, error in abandoned} == {"RuntimeError: CUDA error: an illegal memory access was encountered"}
    assert not retries.isolating and not retries.suspects_left and retries.next_group(idle=True) == []


def test_a_probe_whose_step_fails_having_dropped_nothing_fails():
    """The probe ended only on a failed step that dropped its request: one that dropped nothing
    (the request already gone) left it stepping an empty engine for ever."""
    engine = PoisonEngine(dead=True)
    engine.abort_all = lambda: []  # the failed step's requests were lost before it raised
    retries: FailedStepRetries[str] = FailedStepRetries(engine)
    assert retries.faults.probe() is False
    assert len(engine.groups) == 1


def test_a_step_that_fails_building_outputs_drops_the_requests_finished_in_it(engine_checkpoint, monkeypatch):
    """The engine forgot a finished request while it built the step's outputs: where a later output
    raised, that request was in no `abort_all` list (its caller waited for ever, the batch job never
    wrote its record)."""
    from tests.engine.conftest import conversation
    from vlm_catalog.engine.config import EngineConfig
    from vlm_catalog.engine.llm_engine import LLMEngine
    from vlm_catalog.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=engine_checkpoint))
    try:
        params = SamplingParams(max_tokens=2, ignore_eos=True, output_kind="final_only")
        for index in range(2):  # the same length: both finish in the same step
            engine.add_request(conversation(index, words=3), params, request_id=f"r{index}")
        real_output, built = engine._output, []

        def output(request):
            if request.is_finished:
                built.append(request.request_id)
                if len(built) == 2:
                    raise RuntimeError("a bug building an output")
            return real_output(request)

        monkeypatch.setattr(engine, "_output", output)
        with pytest.raises(RuntimeError, match="a bug building an output"):
            while True:
                assert engine.step() == []  # nothing finishes before the step that raises
        assert sorted(engine.abort_all()) == ["r0", "r1"]
        assert not engine.requests and not engine.detokenizers and not engine.has_unfinished_requests()
        assert engine.block_manager.num_free_blocks == engine.num_blocks
    finally:
        engine.close()


def test_a_request_that_failed_alone_runs_alone_once_more_not_twice():
    """A request alone in the failed step had run alone once already: it was queued as a group of
    one, ran alone twice more and counted twice towards `EngineFailing`."""
    engine = PoisonEngine(poisoned={"bad"})
    results, failed_steps = drive(engine, ["bad"])
    assert results == {"bad": "RuntimeError: CUDA error: an illegal memory access was encountered"}
    assert engine.groups[:2] == [["bad"], ["bad"]] and failed_steps == 2
    assert engine.groups[2][0].startswith("step-faults-probe")  # nothing else ran: a probe confirms it
