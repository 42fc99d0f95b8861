"""Handing answers back to LoadGen, shared by the in-process and the HTTP SUT.

LoadGen identifies a query sample by its response id and copies the response
bytes during `QuerySamplesComplete` (into the accuracy log, as hex of the
UTF-8 text, when it logs that sample). In the Server scenario the SUT also
reports the first streamed token with `FirstTokenComplete`; LoadGen turns
those into TTFT statistics when the run uses token latencies. The sink also
measures TTFT on its own clock (issue to first token), so a run with the
benchmark's settings (no token latencies) still reports it.

A failed request is completed with an empty response (the reference harness
does the same, so LoadGen never waits forever) and counted with its reason.
"""

from __future__ import annotations

import array
import threading
import time
from dataclasses import dataclass, field

import mlperf_loadgen as lg

PRINTED_ERRORS = 5  # failure reasons the command prints (all are written to FAILURES_FILE)


def _response(response_id: int, text: str, n_tokens: int) -> tuple[lg.QuerySampleResponse, array.array]:
    """A QuerySampleResponse pointing at the UTF-8 bytes of `text` (keep the array alive during the call)."""
    data = array.array("B", text.encode("utf-8"))
    address, length = data.buffer_info()
    return lg.QuerySampleResponse(response_id, address, length * data.itemsize, n_tokens), data


@dataclass
class RunTally:
    """What the SUT saw during a run."""

    completed: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)  # every failed sample's reason ("sample I: why"), in order
    ttft_s: list[float] = field(default_factory=list)  # issue -> first token, SUT clock
    completion_tokens: int = 0
    engine_busy_s: float = 0.0  # in-process SUT: time inside the engine's add_request and step
    first_issued_at: float | None = None  # perf_counter of the first issue
    last_completed_at: float | None = None  # perf_counter of the last completion

    @property
    def samples(self) -> int:
        return self.completed + self.failed

    @property
    def active_seconds(self) -> float:
        """First issue to last completion, on the SUT's clock."""
        if self.first_issued_at is None or self.last_completed_at is None:
            return 0.0
        return self.last_completed_at - self.first_issued_at


class ResponseSink:
    """Completes query samples with LoadGen; thread-safe."""

    def __init__(self, report_first_tokens: bool) -> None:
        self.report_first_tokens = report_first_tokens
        self.tally = RunTally()
        self._issued_at: dict[int, float] = {}
        self._first_token_sent: set[int] = set()
        self._lock = threading.Lock()

    def issued(self, response_id: int) -> None:
        now = time.perf_counter()
        with self._lock:
            self._issued_at[response_id] = now
            if self.tally.first_issued_at is None:
                self.tally.first_issued_at = now

    def first_token(self, response_id: int, text: str) -> None:
        """The first generated text of a sample arrived (call once; later calls are ignored)."""
        now = time.perf_counter()
        with self._lock:
            if response_id in self._first_token_sent:
                return
            self._first_token_sent.add(response_id)
            issued_at = self._issued_at.get(response_id)
            if issued_at is not None:
                self.tally.ttft_s.append(now - issued_at)
        if self.report_first_tokens:
            response, _keep = _response(response_id, text, 1)
            lg.FirstTokenComplete([response])

    def complete(self, response_id: int, text: str, n_tokens: int) -> None:
        self._finish(response_id, text, n_tokens, None)

    def fail(self, response_id: int, reason: str) -> None:
        self._finish(response_id, "", 0, reason)

    def _finish(self, response_id: int, text: str, n_tokens: int, error: str | None) -> None:
        with self._lock:
            self.tally.last_completed_at = time.perf_counter()
            self._issued_at.pop(response_id, None)
            needs_first_token = self.report_first_tokens and response_id not in self._first_token_sent
            self._first_token_sent.discard(response_id)
            if error is None:
                self.tally.completed += 1
                self.tally.completion_tokens += n_tokens
            else:
                self.tally.failed += 1
                self.tally.errors.append(error)
        if needs_first_token:  # LoadGen expects a first token before the completion
            response, _keep_first = _response(response_id, text[:1], 1 if text else 0)
            lg.FirstTokenComplete([response])
        response, _keep = _response(response_id, text, n_tokens)
        lg.QuerySamplesComplete([response])
