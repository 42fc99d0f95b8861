"""AsyncLLM when an engine step raises: the step's requests run again by bisection (new ones wait),
only the request that fails alone fails, and a stream whose caller has seen outputs fails at once.
Before, a failed step failed every request then in flight: one record meeting a bug answered 500
to all the service's concurrent clients."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.engine.conftest import conversation
from vlm_catalog import AsyncLLM, SamplingParams
from vlm_catalog.engine.async_engine import EngineInternalError

ERROR = "internal engine error: RuntimeError: CUDA error: an illegal memory access was encountered"


@pytest.fixture(scope="module")
def engine(engine_checkpoint):
    engine = AsyncLLM(model=engine_checkpoint, max_num_seqs=8)
    yield engine
    engine.shutdown()


@pytest.fixture
def steps(engine, monkeypatch):
    """Make the engine's steps raise where `steps.fails(ids scheduled, call number)` says; `steps.scheduled`
    lists the ids of each step that ran work, and `steps.on_failure` runs (engine thread) at each failure."""
    real = engine.engine._run_step
    state = type("Steps", (), {"fails": staticmethod(lambda ids, call: False), "scheduled": [], "on_failure": None})()

    def run_step(output, pending):
        ids = {chunk.request.request_id for chunk in output.chunks}
        if ids:
            state.scheduled.append(ids)
            if state.fails(ids, len(state.scheduled)):
                if state.on_failure is not None:
                    state.on_failure()
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(output, pending)

    monkeypatch.setattr(engine.engine, "_run_step", run_step)
    return state


async def final_output(engine, index, request_id, max_tokens=6, restartable=False, output_kind="final_only"):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=output_kind)
    last = None
    async for output in engine.generate(conversation(index, words=3), params, request_id=request_id,
                                        restartable=restartable):
        last = output
    return last


def answers(engine, count, max_tokens=6):
    async def run():
        return await asyncio.gather(*(final_output(engine, i, f"ref-{i}", max_tokens) for i in range(count)))
    return [output.token_ids for output in asyncio.run(run())]


def assert_clean(engine):
    # the engine thread ends the isolation in its loop's next turn, once it finds no group left
    deadline = time.monotonic() + 10
    while engine._retries.isolating and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine._streams and not engine._parked and not engine._retries.isolating
    assert engine.engine.load_stats()["kv_blocks_used"] == 0 and engine.is_running


def test_a_request_that_fails_every_step_it_is_in_fails_alone(engine, steps, caplog):
    expected = answers(engine, 6)
    steps.fails = lambda ids, call: "r3" in ids

    async def run():
        return await asyncio.gather(*(final_output(engine, i, f"r{i}") for i in range(6)), return_exceptions=True)

    with caplog.at_level("WARNING", logger="vlm_catalog.engine.async_engine"):
        results = asyncio.run(asyncio.wait_for(run(), 120))
    assert isinstance(results[3], EngineInternalError) and str(results[3]) == ERROR
    assert "request r3 failed its engine steps alone: RuntimeError: CUDA error" in caplog.text  # which one, by id
    assert [result.token_ids for i, result in enumerate(results) if i != 3] == expected[:3] + expected[4:]
    assert ["r3"] in [sorted(ids) for ids in steps.scheduled]  # it ran alone, and failed alone
    assert_clean(engine)


def test_the_load_counts_a_failed_steps_requests_as_waiting_while_they_run_again(engine, steps):
    """They were neither running nor waiting in the engine: /metrics showed 4 requests where the
    service held 8."""
    loads = []

    def fails(ids, call):
        if engine._retries.isolating:
            stats = engine.load_stats()
            loads.append((stats["requests_running"] + stats["requests_waiting"], len(engine._streams)))
        return call == 3  # once: nothing is held, so every request still there runs or waits

    steps.fails = fails

    async def run():
        return await asyncio.gather(*(final_output(engine, i, f"r{i}") for i in range(8)))

    asyncio.run(asyncio.wait_for(run(), 120))
    assert loads and all(counted == held for counted, held in loads), loads
    assert engine.load_stats()["requests_waiting"] == 0
    assert_clean(engine)


def test_a_stream_that_showed_outputs_fails_at_once_a_restartable_one_runs_again(engine, steps):
    expected = answers(engine, 3, max_tokens=12)[1:]
    together = []

    def fourth_step_together(ids, call):  # both decoding by then: each has sent outputs
        together.append(ids == {"shown", "kept"})
        return sum(together) == 4 and together[-1]

    steps.fails = fourth_step_together

    async def run():
        return await asyncio.gather(
            final_output(engine, 1, "shown", 12, output_kind="cumulative"),
            final_output(engine, 2, "kept", 12, restartable=True, output_kind="cumulative"),
            return_exceptions=True,
        )

    shown, kept = asyncio.run(asyncio.wait_for(run(), 120))
    assert isinstance(shown, EngineInternalError) and str(shown) == ERROR
    assert kept.finish_reason == "length" and kept.token_ids == expected[1]
    failed_at = [i for i, ids in enumerate(steps.scheduled) if ids == {"shown", "kept"}][3]
    assert {"kept"} in steps.scheduled[failed_at:] and not any("shown" in ids for ids in steps.scheduled[failed_at + 1:])
    assert_clean(engine)


def test_requests_arriving_meanwhile_wait_and_never_join_a_group_of_suspects(engine, steps):
    expected = answers(engine, 8)
    failed = threading.Event()
    steps.fails = lambda ids, call: "r0" in ids
    steps.on_failure = failed.set

    async def late(index):
        while not failed.is_set():
            await asyncio.sleep(0.005)
        return await final_output(engine, index, f"late-{index}")

    async def gone():  # its caller leaves while it waits: nothing of it stays behind
        task = asyncio.ensure_future(late(7))
        await asyncio.sleep(0.05)
        task.cancel()
        return await asyncio.gather(task, return_exceptions=True)

    async def run():
        first = [final_output(engine, i, f"r{i}") for i in range(4)]
        return await asyncio.gather(*first, *(late(i) for i in range(4, 7)), gone(), return_exceptions=True)

    results = asyncio.run(asyncio.wait_for(run(), 120))
    assert isinstance(results[0], EngineInternalError)
    assert [result.token_ids for result in results[1:7]] == expected[1:7]
    for ids in steps.scheduled:  # a step with r0 in it held only the first four
        assert "r0" not in ids or ids <= {"r0", "r1", "r2", "r3"}, ids
    assert_clean(engine)


def test_a_dead_device_fails_each_request_after_its_retries_and_the_engine_serves_on(engine, steps):
    steps.fails = lambda ids, call: True

    async def run():
        return await asyncio.gather(*(final_output(engine, i, f"r{i}") for i in range(4)), return_exceptions=True)

    results = asyncio.run(asyncio.wait_for(run(), 120))
    assert all(isinstance(result, EngineInternalError) for result in results)
    assert "engine steps in a row failed" in str(results[0])
    assert engine.steps_failing
    assert_clean(engine)
    steps.fails = lambda ids, call: False  # the device is back
    assert asyncio.run(engine.probe()) and not engine.steps_failing


def test_a_request_aborted_before_a_failed_step_ends_and_does_not_run_again(engine, steps):
    aborted, done = [], threading.Event()

    def fails(ids, call):  # the first step after the abort: a passing device fault
        request = engine.engine.requests.get("a")
        if request is not None and request.is_finished and not done.is_set():
            done.set()
            return True
        return False

    steps.fails = fails

    async def run():
        long = asyncio.ensure_future(final_output(engine, 0, "a", 200))
        other = asyncio.ensure_future(final_output(engine, 1, "b", 20))
        while sum("a" in ids for ids in steps.scheduled) < 3:
            await asyncio.sleep(0.001)
        await engine.abort("a")  # its caller waits for the final output
        aborted.append(len(steps.scheduled))
        return await asyncio.gather(long, other)

    a, b = asyncio.run(asyncio.wait_for(run(), 60))
    assert done.is_set() and a.finish_reason == "abort" and b.finish_reason == "length"
    assert not any("a" in ids for ids in steps.scheduled[aborted[0] + 1:])  # before: all 200 tokens again
    assert_clean(engine)


def test_an_id_used_again_meanwhile_is_a_new_request_not_the_held_failure(engine, steps):
    """A request failing alone is held; its caller gives up and sends a good request with the same id.
    Before, the held failure (keyed by id) went to the new request, which never ran."""
    alone = threading.Event()
    steps.fails = lambda ids, call: any(engine.engine.requests[i].params.top_p == 0.5 for i in ids if i in engine.engine.requests)

    def on_failure():
        if engine._retries.isolating and len(engine.engine.requests) == 1:
            alone.set()
            deadline = time.monotonic() + 10
            while engine._inbox.qsize() < 2 and time.monotonic() < deadline:  # the abort and the new request
                time.sleep(0.01)

    steps.on_failure = on_failure

    async def run():
        bad = SamplingParams(max_tokens=6, ignore_eos=True, output_kind="final_only", top_p=0.5)
        first = asyncio.ensure_future(_collect(engine, 1, "r1", bad))
        other = asyncio.ensure_future(final_output(engine, 0, "r0"))
        while not alone.is_set():
            await asyncio.sleep(0.001)
        first.cancel()  # its caller's timeout: `generate` aborts it and frees the id
        await asyncio.gather(first, return_exceptions=True)
        return await final_output(engine, 2, "r1"), await other

    again, other = asyncio.run(asyncio.wait_for(run(), 60))
    assert again.finish_reason == "length" and len(again.token_ids) == 6 and other.finish_reason == "length"
    assert_clean(engine)


def test_health_sees_a_hung_probe_step(engine, steps):
    """The probe that confirms a held failure runs steps on the engine thread; `health` did not see
    one hang (only the steps of requests)."""
    release, probing = threading.Event(), threading.Event()
    steps.fails = lambda ids, call: "bad" in ids

    def hang_the_probe(ids, call):
        if any(i.startswith("step-faults-probe") for i in ids):
            probing.set()
            release.wait(10)
        return "bad" in ids

    steps.fails = hang_the_probe

    async def run():
        task = asyncio.ensure_future(final_output(engine, 0, "bad"))
        while not probing.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        problem = engine.health(step_timeout_s=0.2)
        release.set()
        return problem, await asyncio.gather(task, return_exceptions=True)

    problem, (bad,) = asyncio.run(asyncio.wait_for(run(), 60))
    assert problem is not None and problem.startswith("an engine step has run for "), problem
    assert isinstance(bad, EngineInternalError)
    assert_clean(engine)


async def _collect(engine, index, request_id, params):
    last = None
    async for output in engine.generate(conversation(index, words=3), params, request_id=request_id):
        last = output
    return last


def test_a_stream_aborted_before_a_failed_step_ends_with_what_it_showed(engine, monkeypatch):
    """Its final ("abort") output was built after the engine had dropped the request: it carried no
    tokens and no text, where its caller had been shown some (found by test_async_fault_fuzz.py)."""
    failed, real_run_step = threading.Event(), engine.engine._run_step

    def run_step(output, pending):  # the step after the abort (it schedules nothing): a passing fault
        request = engine.engine.requests.get("a")
        if request is not None and request.is_finished and not failed.is_set():
            failed.set()
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_run_step(output, pending)

    monkeypatch.setattr(engine.engine, "_run_step", run_step)

    async def run():
        seen = []
        params = SamplingParams(max_tokens=50, ignore_eos=True)  # a stream, not restartable
        async for output in engine.generate(conversation(0, words=3), params, request_id="a"):
            seen.append(output)
            if len(seen) == 3:
                await engine.abort("a")
        return seen

    seen = asyncio.run(asyncio.wait_for(run(), 60))
    assert failed.is_set() and seen[-1].finish_reason == "abort"
    assert seen[-1].token_ids == seen[-2].token_ids and seen[-1].text == seen[-2].text != ""
    assert_clean(engine)
