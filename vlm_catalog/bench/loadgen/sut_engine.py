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
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import mlperf_loadgen as lg

from vlm_catalog.bench.loadgen.qsl import CatalogueQSL
from vlm_catalog.bench.loadgen.requests import Sampling
from vlm_catalog.bench.loadgen.responses import ResponseSink
from vlm_catalog.engine.llm_engine import EngineRequestError, LLMEngine
from vlm_catalog.engine.sampling_params import SamplingParams
from vlm_catalog.preprocess.processor import ProcessedPrompt

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5
_WAKE = object()  # an inbox entry: samples were issued


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
        self._in_flight: dict[str, tuple[int, int]] = {}  # engine request id -> (LoadGen response id, sample index)
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
        while not self._stop.is_set():
            self._prepare_more()
            self._take_inbox(block=not self.engine.has_unfinished_requests())
            if not self.engine.has_unfinished_requests():
                continue
            started = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - a failed step fails its samples, not the run
                logger.exception("engine step failed; failing the samples in flight")
                self._fail_in_flight(f"engine step failed: {exc}")
                continue
            finally:
                self.sink.tally.engine_busy_s += time.perf_counter() - started
            for output in outputs:
                in_flight = self._in_flight.get(output.request_id)
                if in_flight is None:
                    continue
                response_id, index = in_flight
                if output.token_ids:
                    self.sink.first_token(response_id, output.text)
                if output.finished:
                    del self._in_flight[output.request_id]
                    if output.finish_reason == "error":
                        self.sink.fail(response_id, f"sample {index}: {output.error or 'engine error'}")
                    else:
                        self.sink.complete(response_id, output.text, len(output.token_ids))

    def _prepare_more(self) -> None:
        """Hand issued samples to the pool while fewer than `prepare_ahead` are being prepared or queued."""
        room = self.prepare_ahead - self._num_preparing - self.engine.num_waiting_requests
        while room > 0 and self._issued:
            response_id, index = self._issued.popleft()
            future = self._prepare.submit(self._prepared, index)
            future.add_done_callback(
                lambda done, response_id=response_id, index=index: self._inbox.put((response_id, index, done))
            )
            self._num_preparing += 1
            room -= 1

    def _take_inbox(self, block: bool) -> None:
        """Add every prepared sample that has landed (waiting up to _IDLE_WAIT_S for one if `block`)."""
        try:
            entry = self._inbox.get(block=block, timeout=_IDLE_WAIT_S if block else None)
        except queue.Empty:
            return
        while entry is not None:
            if entry is not _WAKE:
                self._num_preparing -= 1
                self._add(*entry)
            try:
                entry = self._inbox.get_nowait()
            except queue.Empty:
                entry = None

    def _prepared(self, index: int) -> tuple[ProcessedPrompt, SamplingParams]:
        """A sample's prompt and sampling parameters, ready for `add_request` (in the pool)."""
        sample = self.qsl[index]
        if sample.request is None:
            raise ValueError(sample.error)
        params = sample.request.sampling_params(self.sampling, self.max_tokens)
        return self.engine.processor.process(sample.request.messages), params

    def _add(self, response_id: int, index: int, prepared: Future) -> None:
        try:
            prompt, params = prepared.result()
        except Exception as exc:  # noqa: BLE001 - a sample that cannot be prepared fails alone
            self.sink.fail(response_id, f"sample {index}: {exc}")
            return
        request_id = str(response_id)
        started = time.perf_counter()
        try:
            self.engine.add_request(prompt, params, request_id=request_id)
        except (EngineRequestError, ValueError) as exc:
            self.sink.fail(response_id, f"sample {index}: {exc}")
            return
        finally:
            self.sink.tally.engine_busy_s += time.perf_counter() - started
        self._in_flight[request_id] = (response_id, index)

    def _fail_in_flight(self, reason: str) -> None:
        for request_id, (response_id, index) in list(self._in_flight.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - the engine is already in trouble
                logger.exception("abort of %s failed", request_id)
            self.sink.fail(response_id, f"sample {index}: {reason}")
        self._in_flight.clear()
