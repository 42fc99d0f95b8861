"""AsyncLLM under random faults: a seeded stress test of failed steps, aborts, disconnects and fail_all.

A failed step's requests run again by bisection (`engine/step_faults.py`), and each request may meet,
while that happens, its caller aborting it, its caller going away, `fail_all`, new requests arriving
(parked until the suspects have run), another passing fault, or a request that fails every step it
is in. The hand-written cases in test_async_step_faults.py each pin one of these; here a seed draws a
mix of them all, at random moments, so that the interleavings nobody wrote down are tried too.

Each seed draws its requests (output kind final_only or cumulative, restartable or not, greedy with
different max_tokens, some poisoned: every step with one in it raises), when each arrives, which ones
the test aborts or cancels (a client disconnect) and when, the one-off step faults (each step raises
with a small probability) and, for some seeds, a `fail_all`. Moments are counted in engine steps, or
in failed steps (to land while a failed step's requests wait to run again); the engine thread runs on
its own, so which step an abort lands in varies from run to run, but every run of a seed draws the
same scenario. For every seed:

* every `generate` ends (none hangs);
* a request that nothing excused (not poisoned, aborted, cancelled, or in flight at `fail_all`)
  returns exactly the greedy tokens of a clean run (references computed first, without faults),
  unless it is a non-restartable stream that was in flight when a step failed (its caller may have
  seen outputs, so it may end with `EngineInternalError` instead) or passing faults hit both its
  runs alone (bisection then takes the failure for its own);
* a poisoned request not aborted, cancelled or failed by `fail_all` ends with `EngineInternalError`;
* every output any request sees carries a prefix of its reference tokens, a final_only request sees
  one output at most, and a non-restartable stream never goes back on what it showed (its outputs,
  the last one included, carry ever more tokens);
* afterwards the engine is back to clean: no stream, parked request, suspect or held failure left,
  no request in the engine, every KV block free, and it still runs.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass, field

import pytest

from tests.engine.conftest import conversation
from vlm_catalog import AsyncLLM, SamplingParams
from vlm_catalog.engine.async_engine import EngineInternalError, EngineUnavailableError
from vlm_catalog.engine.outputs import RequestOutput

# 327: an abort lands on a stream that has shown tokens, and the next step fails (a one-off fault);
# the final output then carried no tokens, where its caller had been shown some
SEEDS = [0, 1, 2, 3, 4, 5, 327]
NUM_PROMPTS = 6  # distinct prompts; requests share them (and their cached prefixes)
MAX_TOKENS = 12  # the longest answer drawn; references are this long, shorter answers their prefixes
NUM_REQUESTS = 14  # per seed, with at most 8 running at once: some wait in the engine's queue
ONE_OFF_FAULT_RATE = 0.08  # chance that any step raises (low: 16 counted failures in a row is a dead device)
SCENARIO_TIMEOUT_S = 30  # a seed runs in well under a second here: far past this, a `generate` hangs
QUIET_TIMEOUT_S = 10  # for the engine thread to handle the last aborts once every `generate` has ended


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def engine(engine_checkpoint, request):
    """Async scheduling reads a step's tokens in the next step: a failed step then holds tokens not yet read."""
    engine = AsyncLLM(model=engine_checkpoint, max_num_seqs=8, async_scheduling=request.param)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def references(engine) -> list[list[int]]:
    """Each prompt's greedy answer, MAX_TOKENS long, from the engine before any fault."""
    async def run():
        return await asyncio.gather(*(final_tokens(engine, index) for index in range(NUM_PROMPTS)))

    return asyncio.run(asyncio.wait_for(run(), 120))


async def final_tokens(engine, index: int) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, output_kind="final_only")
    async for output in engine.generate(conversation(index, words=3), params, request_id=f"reference-{index}"):
        last = output
    return last.token_ids


# ------------------------------------------------------------------------------------- the scenario
@dataclass(frozen=True)
class Moment:
    """When the test acts: once the engine has run `count` steps with work in them, or (`after_failure`)
    once `count` steps have failed, when the failed step's requests wait to run again."""

    count: int
    after_failure: bool = False


@dataclass
class Planned:
    """One request of a seed's scenario."""

    request_id: str
    prompt: int
    max_tokens: int
    output_kind: str
    restartable: bool
    poisoned: bool
    arrive_at: int  # steps run
    abort_at: Moment | None = None  # the test calls `engine.abort`
    cancel_at: Moment | None = None  # the test cancels the task reading it (a client disconnect)

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, ignore_eos=True, output_kind=self.output_kind)

    @property
    def is_stream_that_cannot_restart(self) -> bool:
        return self.output_kind == "cumulative" and not self.restartable


@dataclass
class Scenario:
    requests: list[Planned]
    fail_all_at: Moment | None


def draw_scenario(seed: int) -> Scenario:
    rng = random.Random(seed)
    poisoned = set(rng.sample(range(NUM_REQUESTS), k=rng.randint(1, 2)))
    requests = []
    for index in range(NUM_REQUESTS):
        planned = Planned(
            request_id=f"seed{seed}-r{index}",
            prompt=rng.randrange(NUM_PROMPTS),
            max_tokens=rng.randint(1, MAX_TOKENS),
            output_kind=rng.choice(["final_only", "cumulative"]),
            restartable=rng.random() < 0.5,
            poisoned=index in poisoned,
            arrive_at=0 if index < NUM_REQUESTS // 2 else rng.randrange(0, 30),
        )
        fate = rng.random()
        if fate < 0.15:
            planned.abort_at = draw_moment(rng, planned.arrive_at)
        elif fate < 0.3:
            planned.cancel_at = draw_moment(rng, planned.arrive_at)
        requests.append(planned)
    fail_all_at = draw_moment(rng, 3) if rng.random() < 0.4 else None
    return Scenario(requests, fail_all_at)


def draw_moment(rng: random.Random, not_before_step: int) -> Moment:
    if rng.random() < 0.5:
        return Moment(not_before_step + rng.randrange(0, 12))
    return Moment(rng.randint(1, 4), after_failure=True)


# ------------------------------------------------------------------------------- injected faults
@dataclass(frozen=True)
class Failure:
    """A step the test made raise: the requests then in the engine (all dropped) and why it failed."""

    in_flight: frozenset[str]
    poisoned: bool  # a poisoned request was in it (else a one-off fault)
    alone_again: bool  # it ran one suspect alone a second time: bisection takes its failure for that request's own


class InjectedFaults:
    """Stands in for `engine.engine._run_step` (on the engine thread): a step that schedules a poisoned
    request raises, and any step that schedules work raises with `rate`, drawn from its own seeded
    generator; `steps` counts the steps that scheduled work, `failures` records each failure."""

    def __init__(self, engine: AsyncLLM, seed: int, poisoned: set[str], rate: float) -> None:
        self.engine = engine
        self.real = engine.engine._run_step
        self.rng = random.Random(f"faults-{seed}")
        self.poisoned = poisoned
        self.rate = rate
        self.steps = 0
        self.failures: list[Failure] = []

    def run_step(self, output, pending):
        scheduled = {chunk.request.request_id for chunk in output.chunks}
        if scheduled:
            self.steps += 1
            poisoned = bool(scheduled & self.poisoned)
            if self.rng.random() < self.rate or poisoned:
                retries = self.engine._retries
                alone_again = retries.isolating and retries._group_size == 1 and retries._again
                self.failures.append(Failure(frozenset(self.engine.engine.requests), poisoned, alone_again))
                cause = "a poisoned request" if poisoned else "a one-off fault"
                raise RuntimeError(f"injected step fault: {cause}")
        return self.real(output, pending)

    def reached(self, moment: Moment) -> bool:
        return (len(self.failures) if moment.after_failure else self.steps) >= moment.count

    def failed_in_flight(self, request_id: str) -> bool:
        return any(request_id in failure.in_flight for failure in self.failures)

    def failed_alone_by_chance(self, request_id: str) -> bool:
        return any(f.alone_again and not f.poisoned and request_id in f.in_flight for f in self.failures)


# -------------------------------------------------------------------------------------- running it
@dataclass
class Seen:
    """What one request's caller saw, with the moments (ticks of one clock on the event loop) its
    `generate` started and ended."""

    outputs: list[RequestOutput] = field(default_factory=list)
    result: RequestOutput | BaseException | None = None
    started: int | None = None
    ended: int | None = None


async def consume(engine: AsyncLLM, planned: Planned, seen: Seen, clock) -> None:
    seen.started = next(clock)
    try:
        async for output in engine.generate(conversation(planned.prompt, words=3), planned.params,
                                            request_id=planned.request_id, restartable=planned.restartable):
            seen.outputs.append(output)
        seen.result = seen.outputs[-1] if seen.outputs else None
    except BaseException as exc:  # noqa: BLE001 - the outcome is checked, a cancellation included
        seen.result = exc
        if isinstance(exc, asyncio.CancelledError):
            raise
    finally:
        seen.ended = next(clock)


async def run_scenario(
    engine: AsyncLLM, scenario: Scenario, faults: InjectedFaults
) -> tuple[dict[str, Seen], int | None]:
    """Send the requests in the order of their moments, and abort or cancel each, and call `fail_all`,
    at theirs; a moment that has lost its point (the request has ended, nothing is in flight) is not
    waited for. Returns what each caller saw and the tick of `fail_all`."""
    clock = itertools.count()
    seen = {planned.request_id: Seen() for planned in scenario.requests}
    tasks: dict[str, asyncio.Task] = {}
    deadline = time.monotonic() + SCENARIO_TIMEOUT_S
    fail_all_tick = []

    def nothing_in_flight() -> bool:
        return all(task.done() for task in tasks.values())

    async def until(moment: Moment, pointless) -> None:
        while not faults.reached(moment) and not pointless() and time.monotonic() < deadline:
            await asyncio.sleep(0.001)

    async def abort_or_cancel(planned: Planned, task: asyncio.Task) -> None:
        if planned.abort_at is not None:
            await until(planned.abort_at, task.done)
            await engine.abort(planned.request_id)
        if planned.cancel_at is not None:
            await until(planned.cancel_at, task.done)
            task.cancel()

    async def send_all() -> list[asyncio.Task]:
        actions = []
        for planned in sorted(scenario.requests, key=lambda planned: planned.arrive_at):
            await until(Moment(planned.arrive_at), nothing_in_flight)
            task = asyncio.ensure_future(consume(engine, planned, seen[planned.request_id], clock))
            tasks[planned.request_id] = task
            actions.append(asyncio.ensure_future(abort_or_cancel(planned, task)))
        return actions

    async def fail_all(moment: Moment, sending: asyncio.Task) -> None:
        await until(moment, lambda: sending.done() and nothing_in_flight())
        fail_all_tick.append(next(clock))
        engine.fail_all("fuzz: fail_all")

    sending = asyncio.ensure_future(send_all())
    failing = [asyncio.ensure_future(fail_all(scenario.fail_all_at, sending))] if scenario.fail_all_at else []
    actions = await sending
    await asyncio.gather(*actions, *failing)
    _, hung = await asyncio.wait(tasks.values(), timeout=max(0.0, deadline - time.monotonic()))
    for task in hung:
        task.cancel()
    for request_id, task in tasks.items():  # one cancelled before it first ran never entered `consume`
        if task.done() and task.cancelled() and seen[request_id].result is None:
            seen[request_id].result = asyncio.CancelledError()
    hung_ids = sorted(request_id for request_id, task in tasks.items() if task in hung)
    assert not hung, f"generate never ended for {hung_ids}: {engine_state(engine)}"
    return seen, (fail_all_tick[0] if fail_all_tick else None)


# --------------------------------------------------------------------------------------- checking
@dataclass
class Fate:
    """What a request met, as far as the test can tell, and so which outcomes it may have."""

    aborted_or_cancelled: bool  # by the test (it may have finished before that landed)
    hit_by_fail_all: bool  # its `generate` ran when `fail_all` was called
    # a non-restartable stream in the engine when a step failed: its caller may have seen outputs
    shown_then_failed: bool
    blamed_by_chance: bool  # one-off faults hit both its runs alone: held as its own failure

    @property
    def excused(self) -> bool:  # from ending as its plan says
        return self.aborted_or_cancelled or self.hit_by_fail_all


def fate_of(planned: Planned, seen: Seen, faults: InjectedFaults, fail_all_tick: int | None) -> Fate:
    return Fate(
        aborted_or_cancelled=planned.abort_at is not None or planned.cancel_at is not None,
        hit_by_fail_all=(fail_all_tick is not None and seen.started is not None
                         and seen.started < fail_all_tick < seen.ended),
        shown_then_failed=planned.is_stream_that_cannot_restart and faults.failed_in_flight(planned.request_id),
        blamed_by_chance=faults.failed_alone_by_chance(planned.request_id),
    )


def check_outputs_seen(planned: Planned, seen: Seen, expected: list[int]) -> None:
    """Every output carries a prefix of the answer; final_only sends one output; a stream that may
    not restart never starts again (a restartable one may: its caller keeps only the last output)."""
    for output in seen.outputs:
        assert output.token_ids == expected[:len(output.token_ids)], (planned, output, expected)
    if planned.output_kind == "final_only":
        assert len(seen.outputs) <= 1 and all(output.finished for output in seen.outputs), (planned, seen.outputs)
    if planned.is_stream_that_cannot_restart:
        lengths = [len(output.token_ids) for output in seen.outputs]
        assert lengths == sorted(lengths), (
            f"{planned.request_id}, a non-restartable stream, went back on what it showed: its outputs carried "
            f"{lengths} tokens, the last {seen.outputs[-1]}")


def check_outcome_allowed(planned: Planned, result, expected: list[int], fate: Fate, faults: InjectedFaults) -> None:
    """However the request ended, something it met allows that ending."""
    if isinstance(result, asyncio.CancelledError):
        assert planned.cancel_at is not None, (planned, "cancelled, but the test never cancelled it")
    elif isinstance(result, EngineUnavailableError):
        assert fate.hit_by_fail_all, (planned, result, "not in flight at fail_all")
    elif isinstance(result, EngineInternalError):
        assert planned.poisoned or fate.blamed_by_chance or fate.shown_then_failed, (planned, result, faults.failures)
    elif isinstance(result, RequestOutput):
        assert result.finished, (planned, result)
        if result.finish_reason == "abort":
            assert planned.abort_at is not None, (planned, result, "aborted, but the test never aborted it")
        else:
            assert not planned.poisoned, (planned, "a poisoned request finished", result)
            assert (result.finish_reason, result.token_ids) == ("length", expected), (planned, result, expected)
    else:
        raise AssertionError((planned, "an unexpected outcome", repr(result)))


def check_outcome_required(planned: Planned, result, expected: list[int], fate: Fate) -> None:
    """A request nothing excused ends as its plan says: a poisoned one, or one blamed by chance, fails;
    any other returns the clean run's answer (a stream that showed outputs may fail instead)."""
    if fate.excused:
        return
    if planned.poisoned or fate.blamed_by_chance:
        assert isinstance(result, EngineInternalError), (planned, "it failed alone, yet did not fail", result)
    elif not (fate.shown_then_failed and isinstance(result, EngineInternalError)):
        assert isinstance(result, RequestOutput) and result.token_ids == expected, (planned, result, expected)


def engine_state(engine: AsyncLLM) -> dict:
    retries = engine._retries
    return {
        "streams": sorted(engine._streams), "parked": [item.request_id for item in engine._parked],
        "isolating": retries.isolating, "suspects": retries.num_suspects, "held": len(retries._held),
        "engine_requests": sorted(engine.engine.requests), "live_ids": sorted(engine._live_ids),
        "kv_blocks_used": engine.engine.load_stats()["kv_blocks_used"], "is_running": engine.is_running,
    }


def assert_clean_when_quiet(engine: AsyncLLM) -> None:
    """Clean once the engine thread has caught up: handled the last aborts (a cancelled `generate` sends
    one as it ends), and run the probe that confirms a failure held for a request whose caller has left."""
    deadline = time.monotonic() + QUIET_TIMEOUT_S
    while not (engine._inbox.empty() and engine_state(engine) == CLEAN) and time.monotonic() < deadline:
        time.sleep(0.01)
    state = engine_state(engine)
    assert state == CLEAN, f"the engine is not clean after the scenario: {state}"


CLEAN = {"streams": [], "parked": [], "isolating": False, "suspects": 0, "held": 0, "engine_requests": [],
         "live_ids": [], "kv_blocks_used": 0, "is_running": True}


# ------------------------------------------------------------------------------------------ the test
@pytest.mark.parametrize("seed", SEEDS)
def test_random_faults_aborts_and_disconnects_leave_every_other_answer_unchanged(engine, references, monkeypatch, seed):
    scenario = draw_scenario(seed)
    poisoned = {planned.request_id for planned in scenario.requests if planned.poisoned}
    faults = InjectedFaults(engine, seed, poisoned, ONE_OFF_FAULT_RATE)
    monkeypatch.setattr(engine.engine, "_run_step", faults.run_step)

    seen, fail_all_tick = asyncio.run(asyncio.wait_for(run_scenario(engine, scenario, faults), SCENARIO_TIMEOUT_S + 10))

    assert faults.failures  # a poisoned request fails at least the first step it is in
    for planned in scenario.requests:
        expected = references[planned.prompt][:planned.max_tokens]
        fate = fate_of(planned, seen[planned.request_id], faults, fail_all_tick)
        check_outputs_seen(planned, seen[planned.request_id], expected)
        check_outcome_allowed(planned, seen[planned.request_id].result, expected, fate, faults)
        check_outcome_required(planned, seen[planned.request_id].result, expected, fate)
    assert_clean_when_quiet(engine)
