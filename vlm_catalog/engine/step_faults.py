"""An engine step that raises, in a driver that owns its requests (the batch job, `LLM`, `AsyncLLM`).

A step runs many requests at once, so its exception does not say whose it is: a
device fault (an out-of-memory on a large batch) is nobody's, a bug one request
meets (its image, its grammar) is that request's, and a dead device fails every
step. `StepFaults.step` runs a step; where it raises, every request in flight is
dropped (`LLMEngine.abort_all`) and handed back, and the driver runs them again
by bisection: in two halves, one after the other with nothing else in the engine;
a half that fails again is halved again. A one-off fault costs the two halves'
runs; a request that fails every step it is in is found in about 2 log2(n) runs of
shrinking groups (before, the n requests ran again one at a time: 256 runs at
batch 1 behind one bad record). One that fails alone runs alone once more (a
passing fault may have hit its run), and one that fails alone twice is that
request's failure; the driver holds it until a later step succeeds (`confirmed`; with nothing left
to run, `probe` runs a one-token request for it), so that a dead device, which
fails every request alone too, fails none of them: after `max_in_a_row` failed
steps in a row, `EngineFailing` stops the driver instead. A group of several
that fails does not count towards that limit (it is halved, so the bisection
ends), nor does a request's second run alone, so a run of bad records in a row
fails as many records as the one-at-a-time retries did before they stopped the
driver.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:  # imported by the batch job's front door, which loads torch only when a run starts
    from vlm_catalog.engine.llm_engine import LLMEngine
    from vlm_catalog.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

# Failed steps in a row that stop a driver: a request that fails alone counts, so several such
# requests in a row (a bug a kind of record meets) must not look like a dead device.
MAX_FAILED_STEPS_IN_A_ROW = 16


Key = TypeVar("Key")  # what a driver runs a request again from (a record, a prompt's index)


class EngineFailing(RuntimeError):
    """Every step failed, many in a row: the device or the engine is broken, not one request."""


@dataclass
class StepResult:
    outputs: list[RequestOutput] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # ids of the requests in flight when the step raised
    error: str | None = None  # what it raised, in one line


class StepFaults:
    def __init__(self, engine: LLMEngine, max_in_a_row: int = MAX_FAILED_STEPS_IN_A_ROW) -> None:
        if max_in_a_row < 1:
            raise ValueError(f"max_in_a_row must be at least 1, got {max_in_a_row}")
        self.engine = engine
        self.max_in_a_row = max_in_a_row
        self.failed_in_a_row = 0
        self.failed_steps = 0
        self.last_error = ""  # what the last failed step raised, in one line
        self.step_started: float | None = None  # `time.monotonic()` of the step running now (any thread may read it)

    @property
    def confirmed(self) -> bool:
        """No counted failure since the last step that read sampled tokens (the device worked then):
        failures held are the requests' own. A group's or a second run's failure is not counted, so a
        request whose own second run read tokens before failing is confirmed by that run."""
        return self.failed_in_a_row == 0

    def step(self, counted: bool = True) -> StepResult:
        """Run one engine step. A failure not `counted` (a group of suspects, which bisection halves)
        leaves the count of failed steps in a row as it was, and so never raises `EngineFailing`."""
        sampled_before = self.engine.stats.num_sampled_tokens
        self.step_started = time.monotonic()
        try:
            try:
                outputs = self.engine.step()
            finally:
                self.step_started = None
        except Exception as exc:  # noqa: BLE001 - whose fault it is is found by running the requests again
            self.failed_in_a_row += counted
            self.failed_steps += 1
            error = self.last_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            if counted and self.failed_in_a_row >= self.max_in_a_row:
                self.engine.abort_all()
                raise EngineFailing(f"{self.failed_in_a_row} engine steps in a row failed, the last with {error}") from exc
            if self.failed_steps == 1 or (counted and self.failed_in_a_row == 1):
                logger.exception("engine step failed; its requests run again, in halves")
            elif counted:  # one traceback is enough: a dead device fails every step the same way
                logger.warning("engine step failed again (%d in a row): %s", self.failed_in_a_row, error)
            else:
                logger.warning("engine step failed again, in a run of suspects: %s", error)
            return StepResult(dropped=self.engine.abort_all(), error=error)
        # only a step that read sampled tokens shows the device works: one with nothing to run (grammars
        # compiling), a prefill chunk that samples nothing, or, with async scheduling, one that only
        # launched its forward (its tokens are read by the next step, which may fail) shows nothing
        if self.engine.stats.num_sampled_tokens > sampled_before:
            self.failed_in_a_row = 0
        return StepResult(outputs=outputs)

    def probe(self) -> bool:
        """Run a one-token text request, with nothing else in the engine: True when its steps
        succeed (the engine works, so the failures held are the requests' own), False when one
        fails (`EngineFailing` once `max_in_a_row` have in a row)."""
        from vlm_catalog.engine.sampling_params import SamplingParams

        request_id = f"step-faults-probe-{self.failed_steps}"
        self.engine.add_request([{"role": "user", "content": "ping"}], SamplingParams(max_tokens=1), request_id=request_id)
        while True:
            result = self.step()
            if any(output.request_id == request_id and output.finished for output in result.outputs):
                return True
            if result.error is not None or not self.engine.has_unfinished_requests():  # failed, or lost
                return False


class FailedStepRetries(Generic[Key]):
    """A driver's side of the module docstring: after a failed step, the requests then in flight
    (`dropped`, by the driver's keys) run again in groups, one group at a time with nothing else
    in the engine (`next_group`); one that fails alone twice in a row is held (`confirmed_failures`
    gives it back with its error once it is shown to be its own).

        retries = FailedStepRetries(engine)
        group = retries.next_group(idle)     # empty: refill the window (unless `isolating`)
        result = retries.step()
        if result.error is not None:
            retries.dropped(keys in flight)   # they left the engine: forget them
        for key, error in retries.confirmed_failures(): ...
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.faults = StepFaults(engine)
        # suspects, in the groups they will run in, in order; True: a single one that failed alone once
        self._groups: deque[tuple[list[Key], bool]] = deque()
        self._group_size = 0  # of the group running now (0: none)
        self._again = False  # the group running now is a single suspect's second run alone
        self.num_suspects = 0  # in the groups still to run (a plain int: any thread may read it)
        self._held: list[tuple[Key, str]] = []
        self.isolating = False  # the driver runs one group of suspects; it adds nothing else

    @property
    def suspects_left(self) -> bool:
        return bool(self._groups)

    def next_group(self, idle: bool) -> list[Key]:
        """The next group of suspects to run together, once the one before has ended (`idle`: none of
        the driver's requests is in the engine); empty when there is none now (no longer `isolating`
        once none is left)."""
        if not (self.isolating and idle):
            return []
        if self._groups:
            group, self._again = self._groups.popleft()
            self._group_size = len(group)
            self.num_suspects -= len(group)
            return group
        self.isolating = False
        self._group_size = 0
        return []

    def step(self) -> StepResult:
        """`StepFaults.step`; a group of several suspects failing, or a single one's second run alone,
        does not count towards `EngineFailing` (each bad request counts once, as one at a time did)."""
        return self.faults.step(counted=not (self.isolating and (self._group_size > 1 or self._again)))

    def dropped(self, keys: list[Key]) -> None:
        """The driver's requests in flight when the step raised (`StepResult.error`): halved into two
        groups to run first; if one ran alone, run alone once more, and after that a failure held
        as its own."""
        if self.isolating and self._group_size == 1 and self._again:
            error = self.faults.last_error
            self._held += [(key, error) for key in keys]
            return
        if len(keys) == 1:  # it ran alone (a group of one, or the only one of the driver's left in the step)
            groups = [(keys, True)]
        else:
            half = (len(keys) + 1) // 2
            groups = [(group, False) for group in (keys[:half], keys[half:]) if group]
        self._groups.extendleft(reversed(groups))
        self.num_suspects += len(keys)
        self.isolating = self.isolating or bool(keys)
        self._group_size = 0  # it has left the engine

    def abandon(self) -> list[tuple[Key, str]]:
        """Give up (`EngineFailing` in a driver that goes on): every suspect and held failure, with the
        last error, and nothing left to isolate."""
        error = self.faults.last_error
        abandoned = [(key, error) for group, _ in self._groups for key in group] + self._held
        self._groups.clear()
        self.num_suspects = 0
        self._held = []
        self.isolating = False
        self._group_size = 0
        return abandoned

    def confirmed_failures(self, finished: bool = False) -> list[tuple[Key, str]]:
        """The held failures, with their errors, once a step that ran work has succeeded since; with
        `finished` (nothing left to run), once `probe` succeeds. Empty until then."""
        if not self._held:
            return []
        if finished:
            while not self.faults.probe():  # nothing left to show the engine works
                pass
        elif not self.faults.confirmed:
            return []
        held, self._held = self._held, []
        return held
