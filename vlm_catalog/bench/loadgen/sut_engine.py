"""A LoadGen SUT that drives the in-process engine (`LLMEngine`).

One engine thread owns the engine (it is not thread-safe). LoadGen's
`issue_query` only queues the query samples, so it never blocks LoadGen.
Before each step the engine thread hands issued samples to a pool of
prompt-preparing threads (chat template, tokens, image headers:
`PromptProcessor.process`) while fewer than `prepare_ahead` are being
prepared or wait in the engine; each prepared prompt lands in the engine
thread's inbox, and the engine thread adds whatever has landed before each
step. In the Offline scenario all samples arrive in one call: the engine
starts on the first prepared ones, and the pool stays at most `prepare_ahead`
samples ahead of what runs. Preparing all of a 48k-sample burst at once
would hold every prepared prompt in memory (about 12 KiB each with the
shipped model, some 0.6 GB) for no gain, since the engine runs at most
`max_num_seqs` of them, and would keep both threads busy for about a minute,
which stretched a model engine thread's steps by 6% on the CPU machine
(`scripts/bench_gil_contention.py`). In the Server scenario samples arrive
one by one at Poisson times and join the running batch at the next step.
Each step's outputs are streamed: the first generated text of a sample is
reported as its first token (Server), and a finished request completes its
sample at once, so LoadGen sees each latency as it happens.
The time spent inside the engine (`add_request`, `step`) is added up in
`sink.tally.engine_busy_s`: against LoadGen's measured duration it gives
the harness's own overhead.

A step that raises is the other drivers' case (`engine/step_faults.py`): its
samples run again by bisection while newly prepared ones wait, so a passing
device fault costs no answer and only a sample that fails alone is failed;
after 16 failed steps in a row (a dead device) every sample in flight is
failed and the run ends soon. Whatever else goes wrong on the engine thread
fails the samples it holds: LoadGen waits for ever on a sample never completed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import mlperf_loadgen as lg

from vlm_catalog.bench.loadgen.qsl import CatalogueQSL
from vlm_catalog.bench.loadgen.requests import Sampling
from vlm_catalog.bench.loadgen.responses import ResponseSink
from vlm_catalog.engine.llm_engine import EngineRequestError, LLMEngine
from vlm_catalog.engine.sampling_params import SamplingParams
from vlm_catalog.engine.step_faults import EngineFailing, FailedStepRetries
from vlm_catalog.preprocess.processor import ProcessedPrompt

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5
_WAKE = object()  # an inbox entry: samples were issued


@dataclass
class _Sample:
    """A sample in the engine, with what adds it again after a failed step."""

    response_id: int
    index: int
    prompt: ProcessedPrompt
    params: SamplingParams

    @property
    def request_id(self) -> str:
        return str(self.response_id)


class EngineSUT:
    """Use as a context manager: starts the engine thread and constructs the LoadGen SUT."""

    def __init__(
        self,
        engine: LLMEngine,
        qsl: CatalogueQSL,
        sampling: Sampling,
        max_tokens: int,
        sink: ResponseSink,
        prepare_workers: int = 2,
        prepare_ahead: int | None = None,
    ) -> None:
        """`prepare_workers`: threads preparing prompts. Two keep far ahead of the engine (a prompt
        takes 1-2 ms) without many threads taking the GIL from the engine thread's host work.
        `prepare_ahead`: at most this many issued samples are being prepared or wait in the engine's
        queue (None: the engine's `max_num_seqs`, at least 64); the rest wait as bare sample indices."""
        self.engine = engine
        self.qsl = qsl
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.sink = sink
        self.prepare_ahead = prepare_ahead if prepare_ahead is not None else max(64, engine.config.max_num_seqs)
        if self.prepare_ahead < 1:
            raise ValueError(f"prepare_ahead must be at least 1, got {self.prepare_ahead}")
        self._issued: deque[tuple[int, int]] = deque()  # (response id, sample index), not yet handed to the pool
        # (response id, sample index, Future of the prepared prompt); _WAKE: samples were issued; None: stop
        self._inbox: queue.Queue = queue.Queue()
        self._prepare = ThreadPoolExecutor(prepare_workers, thread_name_prefix="bench-prepare")
        self._num_preparing = 0  # handed to the pool and not yet added (engine thread only)
        self._prepared_samples: deque[tuple[int, int, Future]] = deque()  # landed, waiting while isolating
        self._in_flight: dict[str, _Sample] = {}  # by engine request id: added, or waiting to run again
        self._retries: FailedStepRetries[_Sample] = FailedStepRetries(engine)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-engine", daemon=True)
        self.handle = None

    def __enter__(self) -> EngineSUT:
        self._thread.start()
        self.handle = lg.ConstructSUT(self.issue_queries, self.flush_queries)
        return self

    def __exit__(self, *exc_info) -> None:
        self._prepare.shutdown(wait=False, cancel_futures=True)
        self._stop.set()
        self._inbox.put(None)
        self._thread.join()
        if self.handle is not None:
            lg.DestroySUT(self.handle)
            self.handle = None

    # ------------------------------------------------------- LoadGen thread
    def issue_queries(self, query_samples: list) -> None:
        for sample in query_samples:
            self.sink.issued(sample.id)
            self._issued.append((sample.id, sample.index))
        self._inbox.put(_WAKE)

    def flush_queries(self) -> None:
        """Nothing is held back longer than `prepare_ahead` requires: samples go on being prepared
        as the engine's queue drains, and each is added as soon as it is prepared."""

    # -------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:  # noqa: BLE001 - logged; LoadGen must not wait for ever on what it held
            logger.exception("the benchmark's engine thread failed")
            self._fail_everything("the engine thread failed")
            while not self._stop.is_set():  # samples still issued fail as they come
                self._fail_everything("the engine thread failed")
                self._stop.wait(_IDLE_WAIT_S)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._prepare_more()
            self._take_inbox(block=not self.engine.has_unfinished_requests() and not self._retries.isolating)
            self._admit()
            if not self.engine.has_unfinished_requests():
                if not self._retries.isolating:  # nothing left to run: a failure held is confirmed by a probe
                    self._fail_confirmed(finished=True)
                continue
            started = time.perf_counter()
            try:
                result = self._retries.step()
            except EngineFailing as exc:  # a dead device: fail what ran, and the samples still to come
                self._fail_everything(str(exc))
                continue
            finally:
                self.sink.tally.engine_busy_s += time.perf_counter() - started
            if result.error is not None:
                self._retries.dropped([self._in_flight[rid] for rid in result.dropped if rid in self._in_flight])
            self._fail_confirmed()
            for output in result.outputs:
                sample = self._in_flight.get(output.request_id)
                if sample is None:
                    continue
                if output.token_ids:
                    self.sink.first_token(sample.response_id, output.text)
                if output.finished:
                    del self._in_flight[output.request_id]
                    if output.finish_reason == "error":
                        self.sink.fail(sample.response_id, f"sample {sample.index}: {output.error or 'engine error'}")
                    else:
                        self.sink.complete(sample.response_id, output.text, len(output.token_ids))

    def _prepare_more(self) -> None:
        """Hand issued samples to the pool while fewer than `prepare_ahead` are being prepared or queued."""
        room = (self.prepare_ahead - self._num_preparing - len(self._prepared_samples)
                - self.engine.num_waiting_requests)
        while room > 0 and self._issued:
            response_id, index = self._issued.popleft()
            future = self._prepare.submit(self._prepared, index)
            future.add_done_callback(
                lambda done, response_id=response_id, index=index: self._inbox.put((response_id, index, done))
            )
            self._num_preparing += 1
            room -= 1

    def _take_inbox(self, block: bool) -> None:
        """Take every prepared sample that has landed (waiting up to _IDLE_WAIT_S for one if `block`)."""
        try:
            entry = self._inbox.get(block=block, timeout=_IDLE_WAIT_S if block else None)
        except queue.Empty:
            return
        while entry is not None:
            if entry is not _WAKE:
                self._num_preparing -= 1
                self._prepared_samples.append(entry)
            try:
                entry = self._inbox.get_nowait()
            except queue.Empty:
                entry = None

    def _admit(self) -> None:
        """Into the engine: the next group of a failed step's samples, once the one before has ended;
        the prepared samples, unless such groups are running."""
        for sample in self._retries.next_group(idle=not self.engine.has_unfinished_requests()):
            self._start(sample)
        while self._prepared_samples and not self._retries.isolating:
            response_id, index, prepared = self._prepared_samples.popleft()
            try:
                prompt, params = prepared.result()
            except Exception as exc:  # noqa: BLE001 - a sample that cannot be prepared fails alone
                self.sink.fail(response_id, f"sample {index}: {exc}")
                continue
            self._start(_Sample(response_id, index, prompt, params))

    def _start(self, sample: _Sample) -> None:
        started = time.perf_counter()
        try:
            self.engine.add_request(sample.prompt, sample.params, request_id=sample.request_id)
        except Exception as exc:  # noqa: BLE001 - refused, or a bug this sample meets: it fails alone
            if not isinstance(exc, (EngineRequestError, ValueError)):
                logger.exception("adding sample %d failed", sample.index)
            self._in_flight.pop(sample.request_id, None)
            self.sink.fail(sample.response_id, f"sample {sample.index}: {exc}")
            return
        finally:
            self.sink.tally.engine_busy_s += time.perf_counter() - started
        self._in_flight[sample.request_id] = sample

    def _fail_confirmed(self, finished: bool = False) -> None:
        try:
            failures = self._retries.confirmed_failures(finished)
        except EngineFailing as exc:  # its probe failed many times
            self._fail_everything(str(exc))
            return
        for sample, error in failures:
            self._in_flight.pop(sample.request_id, None)
            self.sink.fail(sample.response_id, f"sample {sample.index}: engine step failed: {error}")

    def _fail_everything(self, reason: str) -> None:
        """Fail every sample this SUT holds: in the engine, waiting to run again, prepared or issued."""
        self._retries.abandon()
        try:
            self.engine.abort_all()
        except Exception:  # noqa: BLE001 - the engine is already in trouble
            logger.exception("dropping the engine's requests failed")
        failed = [(sample.response_id, sample.index) for sample in self._in_flight.values()]
        failed += [(response_id, index) for response_id, index, _ in self._prepared_samples]
        self._in_flight.clear()
        self._prepared_samples.clear()
        while self._issued:
            failed.append(self._issued.popleft())
        while True:  # those being prepared land in the inbox
            try:
                entry = self._inbox.get_nowait()
            except queue.Empty:
                break
            if entry is not _WAKE and entry is not None:
                self._num_preparing -= 1
                failed.append(entry[:2])
        for response_id, index in failed:
            self.sink.fail(response_id, f"sample {index}: {reason}")

    def _prepared(self, index: int) -> tuple[ProcessedPrompt, SamplingParams]:
        """A sample's prompt and sampling parameters, ready for `add_request` (in the pool)."""
        sample = self.qsl[index]
        if sample.request is None:
            raise ValueError(sample.error)
        params = sample.request.sampling_params(self.sampling, self.max_tokens)
        return self.engine.processor.process(sample.request.messages), params
