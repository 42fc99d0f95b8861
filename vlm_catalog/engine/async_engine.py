"""Asynchronous front of the engine, for servers.

    engine = AsyncLLM(model="path/to/checkpoint")
    async for output in engine.generate(messages, SamplingParams(...)):
        ...                      # streamed outputs; the last one has finished=True
    await engine.abort(request_id)

One background thread owns the `LLMEngine` (it is not thread-safe) and runs
steps while there is work. Callers talk to it through an inbox; outputs come
back to each request's asyncio queue on the caller's event loop. Prompt
preprocessing (template, tokenisation, image headers) runs in a worker thread,
off both the event loop and the engine thread. A request's outputs not yet read
are merged into one (`_LatestOutput`), so a caller that reads slowly, or not at
all, holds one output, not one per step. A request that fails raises
`EngineRequestError` in its own `generate` only; a request id already in
flight is refused at once (the caller picks ids, or lets `AsyncLLM` number
them). A step that raises (a bug one request meets, a passing device fault)
is logged, and the requests then in flight run again by bisection
(`engine/step_faults.py`): new requests wait meanwhile, and the one that fails
alone raises `EngineInternalError`; a request whose caller has seen outputs
already (a stream) cannot start again unseen, and raises it at once, unless
the caller said it keeps only the final output (`restartable`). The engine
goes on serving. Once the
engine is shut down, or its thread has died, `generate` raises
`EngineUnavailableError` and `is_running` is False. `health` says what is
wrong besides: steps that all fail (a dead device), or one that runs too long
(a hung one); `probe` runs a one-token request to see whether it recovered.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from vlm_catalog.engine.config import EngineConfig
from vlm_catalog.engine.llm_engine import EngineRequestError, LLMEngine
from vlm_catalog.engine.outputs import RequestOutput
from vlm_catalog.engine.sampling_params import SamplingParams
from vlm_catalog.engine.step_faults import EngineFailing, FailedStepRetries
from vlm_catalog.preprocess.processor import ProcessedPrompt

logger = logging.getLogger(__name__)

# failed steps in a row after which `health` reports the engine failing (one is a request's bug, or
# a passing device fault; a dead device fails every step)
UNHEALTHY_AFTER_FAILED_STEPS = 3


class _LatestOutput:
    """A request's outputs not yet read, as one: the newest (its text and tokens are all so far)
    with the delta texts of those it replaced joined, or the error that ended the request.
    Used on the event loop's thread only. Before, a queue kept every step's output, each with a
    copy of all tokens so far: a stream whose client stopped reading grew by gigabytes."""

    def __init__(self) -> None:
        self._item: RequestOutput | Exception | None = None
        self._ready = asyncio.Event()

    def put_nowait(self, item: RequestOutput | Exception) -> None:
        pending = self._item
        if isinstance(pending, Exception):
            return  # the request has ended
        if isinstance(pending, RequestOutput) and isinstance(item, RequestOutput):
            item = replace(item, delta_text=pending.delta_text + item.delta_text)
        self._item = item
        self._ready.set()

    async def get(self) -> RequestOutput | Exception:
        await self._ready.wait()
        item, self._item = self._item, None
        self._ready.clear()
        return item


@dataclass
class _Add:
    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    outputs: _LatestOutput
    loop: asyncio.AbstractEventLoop
    restartable: bool = False  # its caller keeps only the final output: it may run again from the start
    last_output: RequestOutput | None = None  # the last output not final that went to its caller (engine thread)
    aborted: bool = False  # its caller aborted it while it ran (engine thread only)

    @property
    def can_run_again(self) -> bool:
        return (self.restartable or self.last_output is None) and not self.aborted


@dataclass
class _Abort:
    request_id: str


@dataclass
class _FailAll:
    error: Exception


class EngineUnavailableError(RuntimeError):
    """The engine is shut down or its thread has died: no request can run."""


class EngineInternalError(RuntimeError):
    """A bug inside an engine step: the request failed its steps alone, or its caller had seen outputs
    already when a step failed."""


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        self.engine = LLMEngine(config, **overrides)
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, _Add] = {}  # every request from its arrival on the engine thread to its end
        # by the request (not its id: a caller may use an id again while the request it named waits to run again)
        self._retries: FailedStepRetries[_Add] = FailedStepRetries(self.engine)
        self._parked: deque[_Add] = deque()  # arrived while a failed step's requests run again
        self._ids = itertools.count()
        self._live_ids: set[str] = set()  # ids between the start and the end of their `generate`
        self._live_lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vlm-catalog-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    @property
    def failed_steps_in_a_row(self) -> int:
        return self._retries.faults.failed_in_a_row

    @property
    def steps_failing(self) -> bool:
        return self.failed_steps_in_a_row >= UNHEALTHY_AFTER_FAILED_STEPS

    def health(self, step_timeout_s: float) -> str | None:
        """What keeps the engine from serving, or None: its thread stopped, its last steps all failed,
        or the step running now has run longer than `step_timeout_s`. Plain reads, from any thread."""
        if not self.is_running:
            return "engine not running"
        started = self._retries.faults.step_started  # its probes' steps too
        if started is not None and time.monotonic() - started > step_timeout_s:
            return f"an engine step has run for {time.monotonic() - started:.0f} s"
        if self.steps_failing:
            return f"the last {self.failed_steps_in_a_row} engine steps failed"
        return None

    async def probe(self) -> bool:
        """Run a one-token text request: True when it is answered (its step ends a run of failed ones)."""
        try:
            async for _ in self.generate([{"role": "user", "content": "ping"}],
                                         SamplingParams(max_tokens=1, output_kind="final_only")):
                pass
        except (EngineRequestError, EngineUnavailableError, EngineInternalError):
            return False
        return True

    def load_stats(self) -> dict[str, float]:
        """The engine's current load (see `LLMEngine.load_stats`); plain reads, safe from any thread.
        Waiting counts a failed step's requests waiting to run again and those that arrived meanwhile."""
        stats = self.engine.load_stats()
        stats["requests_waiting"] += self._retries.num_suspects + len(self._parked)
        return stats

    async def generate(
        self,
        prompt: list[dict[str, Any]] | ProcessedPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        restartable: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs.

        Raises `EngineRequestError` if the request is refused (bad prompt or
        settings, or `request_id` already in flight), `EngineUnavailableError`
        if the engine is not running, `EngineInternalError` if the request
        failed alone in a step (or a step failed after the caller had seen
        outputs). `restartable`: the caller keeps only the final output, so
        after a failed step the request may run again from its start even
        though outputs went out (they start again too).
        """
        if not self.is_running:
            raise EngineUnavailableError("the engine is not running (shut down, or its thread died)")
        params = params or SamplingParams()
        request_id = request_id or f"async-{next(self._ids)}"
        with self._live_lock:
            if request_id in self._live_ids:
                raise EngineRequestError(f"request id {request_id!r} is already in flight")
            self._live_ids.add(request_id)
        try:
            async for output in self._generate(prompt, params, request_id, restartable):
                yield output
        finally:
            with self._live_lock:
                self._live_ids.discard(request_id)

    async def _generate(
        self, prompt: list[dict[str, Any]] | ProcessedPrompt, params: SamplingParams, request_id: str, restartable: bool
    ) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        if not isinstance(prompt, ProcessedPrompt):
            try:
                prompt = await loop.run_in_executor(None, self.engine.processor.process, prompt)
            except ValueError as exc:
                raise EngineRequestError(str(exc)) from None
        outputs = _LatestOutput()
        with self._live_lock:  # the engine thread, when it ends, fails every _Add queued before it
            if self._stopped.is_set():
                raise EngineUnavailableError("the engine is not running (shut down, or its thread died)")
            self._inbox.put(_Add(request_id, prompt, params, outputs, loop, restartable))
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, Exception):
                    finished = True  # the engine has forgotten the request already
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the caller stopped listening (disconnect, cancel): free the slot
                self._inbox.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def fail_all(self, reason: str) -> None:
        """Abort every request in flight, its `generate` raising `EngineUnavailableError(reason)`.
        From any thread (a server's shutdown deadline); the engine goes on serving."""
        self._inbox.put(_FailAll(EngineUnavailableError(reason)))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._inbox.put(None)
        self._thread.join(timeout)
        self.engine.close()

    # ------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:  # logged, not re-raised: `is_running` and the failed streams report it
            logger.exception("the engine thread died")
        finally:  # nobody may wait forever: fail what is in flight and what is still queued
            with self._live_lock:
                self._stopped.set()
                try:  # its blocks and queues freed: the load it reports is none, not frozen
                    self.engine.abort_all()
                except Exception:  # noqa: BLE001 - the engine is already in trouble
                    logger.exception("dropping the engine's requests failed")
                self._parked.clear()
                self._retries.abandon()
                self._fail_streams(EngineUnavailableError("the engine stopped"))
                while (item := self._next_inbox_item()) is not None or not self._inbox.empty():
                    if isinstance(item, _Add):
                        item.loop.call_soon_threadsafe(item.outputs.put_nowait, EngineUnavailableError("the engine stopped"))

    def _loop(self) -> None:
        while not self._stopped.is_set():
            busy = self.engine.has_unfinished_requests() or self._retries.isolating
            self._drain_inbox(block=not busy)
            if self._stopped.is_set():
                break
            self._admit()
            if not self.engine.has_unfinished_requests():
                if not self._retries.isolating:  # nothing left to run: a failure held is confirmed by a probe
                    self._fail_confirmed(finished=True)
                continue
            try:
                result = self._retries.step()
            except EngineFailing as exc:  # steps fail whatever runs: fail what ran, serve on (`health` says so)
                self._fail_all_but_parked(exc)
                continue
            if result.error is not None:
                self._run_again(result.dropped, result.error)
            self._fail_confirmed()
            self._deliver_step(result.outputs)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            return
        while item is not None:
            if isinstance(item, _Add):
                if item.request_id in self._streams:  # defensive: `generate` refuses live ids already
                    item.loop.call_soon_threadsafe(
                        item.outputs.put_nowait, EngineRequestError(f"request id {item.request_id!r} is already in flight")
                    )
                    item = self._next_inbox_item()
                    continue
                self._streams[item.request_id] = item
                if self._retries.isolating:  # a failed step's requests run again first, with nothing else
                    self._parked.append(item)
                else:
                    self._add(item)
            elif isinstance(item, _Abort):
                self._abort(item.request_id)
            elif isinstance(item, _FailAll):
                for request_id in list(self._streams):
                    self.engine.abort(request_id)
                self._fail_streams(item.error)
            item = self._next_inbox_item()

    def _next_inbox_item(self) -> _Add | _Abort | _FailAll | None:
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _add(self, item: _Add) -> None:
        try:
            self.engine.add_request(item.prompt, item.params, request_id=item.request_id)
        except EngineRequestError as exc:
            self._deliver(item.request_id, exc, last=True)
        except Exception as exc:  # noqa: BLE001 - a bug one request meets must not take the service down
            logger.exception("adding request %s failed", item.request_id)  # registered nowhere yet
            self._deliver(item.request_id, EngineInternalError(f"internal engine error: {exc}"), last=True)

    def _admit(self) -> None:
        """Into the engine: the next group of a failed step's requests, once the one before has ended;
        once none is left, the requests that arrived meanwhile. Those whose callers left are skipped."""
        for item in self._retries.next_group(idle=not self.engine.has_unfinished_requests()):
            if self._streams.get(item.request_id) is item:
                self._add(item)
        while self._parked and not self._retries.isolating:
            item = self._parked.popleft()
            if self._streams.get(item.request_id) is item:
                self._add(item)

    def _abort(self, request_id: str) -> None:
        item = self._streams.get(request_id)
        if request_id in self.engine.requests:
            self.engine.abort(request_id)  # its final output comes with the next step
            if item is not None:
                item.aborted = True  # if that step fails, it is not run again
        elif item is not None:  # waiting to run again, or parked meanwhile: ends here
            self._end_aborted(item)

    def _end_aborted(self, item: _Add) -> None:
        """Its final output, where the engine no longer has the request: what its caller was shown."""
        shown = item.last_output
        output = RequestOutput(item.request_id, shown.text if shown else "", list(shown.token_ids) if shown else [],
                               len(item.prompt.token_ids), True, "abort")
        self._deliver(item.request_id, output, last=True)

    def _run_again(self, dropped: list[str], error: str) -> None:
        """A failed step's requests: run again by bisection, but those whose callers saw outputs fail
        now, and those aborted end."""
        again = []
        for request_id in dropped:
            item = self._streams.get(request_id)
            if item is None:
                continue
            if item.aborted:
                self._end_aborted(item)
            elif item.can_run_again:
                again.append(item)
            else:
                logger.warning("request %s: an engine step failed after its caller had seen outputs, so it cannot "
                               "start again: %s", request_id, error)
                self._deliver(request_id, EngineInternalError(f"internal engine error: {error}"), last=True)
        self._retries.dropped(again)

    def _fail_confirmed(self, finished: bool = False) -> None:
        try:
            failures = self._retries.confirmed_failures(finished)
        except EngineFailing as exc:  # its probe failed many times
            self._fail_all_but_parked(exc)
            return
        for item, error in failures:
            if self._streams.get(item.request_id) is item:
                logger.warning("request %s failed its engine steps alone: %s", item.request_id, error)
                self._deliver(item.request_id, EngineInternalError(f"internal engine error: {error}"), last=True)

    def _fail_all_but_parked(self, exc: EngineFailing) -> None:
        """Fail the requests that ran or wait to run again (the engine has dropped them); those that
        arrived meanwhile run next."""
        self._retries.abandon()
        parked = {item.request_id for item in self._parked}
        for request_id in [request_id for request_id in self._streams if request_id not in parked]:
            self._deliver(request_id, EngineInternalError(f"internal engine error: {exc}"), last=True)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, one wake-up per event loop (not one per request)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_LatestOutput, RequestOutput]]] = {}
        for output in outputs:
            item = self._streams.pop(output.request_id, None) if output.finished else self._streams.get(output.request_id)
            if item is not None:
                if not output.finished:
                    item.last_output = output
                batches.setdefault(item.loop, []).append((item.outputs, output))
        for loop, batch in batches.items():
            if not loop.is_closed():
                loop.call_soon_threadsafe(_put_all, batch)

    def _deliver(self, request_id: str, item: RequestOutput | Exception, last: bool) -> None:
        stream = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if stream is None:
            return
        if not stream.loop.is_closed():
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, item)

    def _fail_streams(self, exc: Exception) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, exc, last=True)


def _put_all(batch: list[tuple[_LatestOutput, RequestOutput]]) -> None:
    for outputs, item in batch:
        outputs.put_nowait(item)
