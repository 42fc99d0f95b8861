"""Between HTTP handlers and `AsyncLLM`: admission, ids, timeouts, disconnects, error mapping, metrics.

* Admission: at most `max_num_seqs + max_waiting_requests` requests are in the
  service at once; past that a request is answered 429 with `Retry-After` at
  once, before its body is read (`body_guard.py`), so a burst costs no memory.
* Every request gets a fresh server-side id (`<kind>-<uuid>`); client-given ids
  never reach the engine.
* A request runs at most `request_timeout_s` (then 408 and it is aborted); a stream whose
  client stops reading is dropped soon after (`StreamWithDeadline`).
* A client that disconnects has its request aborted at once: `AsyncLLM.generate`
  aborts the engine request when its consumer stops listening, which frees the
  request's KV blocks in the engine's next loop iteration.
* Engine outcomes become HTTP ones: a refused prompt or a request the engine
  failed (unreadable pixels, an output constraint that does not compile) is a
  400; a stopped engine is 503; a request that fails an engine step alone is a
  500 (a bug; the step's other requests run again, `AsyncLLM`), as is a stream
  whose step failed after its first events went out.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from vlm_catalog.engine.async_engine import AsyncLLM, EngineInternalError, EngineUnavailableError
from vlm_catalog.engine.llm_engine import INVALID_CONSTRAINT, EngineRequestError
from vlm_catalog.engine.outputs import RequestOutput
from vlm_catalog.engine.sampling_params import SamplingParams
from vlm_catalog.preprocess.processor import ProcessedPrompt
from vlm_catalog.server.errors import APIError
from vlm_catalog.server.metrics import ServiceMetrics
from vlm_catalog.server.settings import ServerSettings

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before its answer was ready."""


@dataclass
class Finished:
    output: RequestOutput  # the final output (finish_reason "stop" or "length")
    time_to_first_token: float | None  # seconds from arrival, as the service saw it
    seconds: float  # arrival to the last token


def new_request_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def arrival(request: Request) -> float:
    """When the request arrived (`RequestBodyGuard` stamps it; now, for an app without it)."""
    return getattr(request.state, "arrived", None) or time.perf_counter()


class Admission:
    """Places held in the service; `release` is idempotent (a stream may release from two paths)."""

    def __init__(self, gateway: EngineGateway, count: int) -> None:
        self.gateway = gateway
        self.count = count

    def release(self) -> None:
        if self.count:
            self.gateway.in_flight -= self.count
            self.count = 0

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class EngineGateway:
    def __init__(self, engine: AsyncLLM, settings: ServerSettings, metrics: ServiceMetrics) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.capacity = engine.engine.config.max_num_seqs + settings.max_waiting_requests
        self.in_flight = 0  # event-loop only

    # ------------------------------------------------------------- admission
    def admit(self, count: int = 1) -> Admission:
        """Take `count` places in the service (release them with the returned `Admission`); 429 if not free."""
        busy = self.busy_error(count)
        if busy is not None:
            raise busy
        self.in_flight += count
        return Admission(self, count)

    def busy_error(self, count: int = 1) -> APIError | None:
        """The 429 for a request of `count` places now, or None if they are free."""
        if self.in_flight + count <= self.capacity:
            return None
        return APIError(
            429,
            f"the service is at capacity ({self.in_flight} requests in flight, at most {self.capacity}); "
            f"retry in {self.settings.retry_after_s} s",
            type="rate_limit_error", code="server_busy",
            headers={"Retry-After": str(self.settings.retry_after_s)},
        )

    # ------------------------------------------------------------ generation
    async def outputs(
        self, prompt: list[dict[str, Any]] | ProcessedPrompt, params: SamplingParams, request_id: str,
        constraint_param: str | None = None, restartable: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs with its refusals and failures as `APIError`s; a constraint that
        did not compile is the field `constraint_param`'s error. `restartable`: see `AsyncLLM.generate`."""
        try:
            async with contextlib.aclosing(self.engine.generate(prompt, params, request_id, restartable)) as stream:
                async for output in stream:
                    if output.finished and output.finish_reason == "error":
                        error = output.error or "the request failed"
                        if constraint_param is not None and error.startswith(INVALID_CONSTRAINT):
                            raise APIError(400, error, param=constraint_param, code="invalid_response_format")
                        raise APIError(400, error, code="request_failed")
                    yield output
        except EngineRequestError as exc:
            raise APIError(400, str(exc), code="invalid_prompt") from None
        except EngineUnavailableError as exc:
            raise APIError(503, str(exc), type="server_error", code="engine_unavailable") from None
        except EngineInternalError as exc:
            raise APIError(500, str(exc), type="server_error", code="internal_error") from None

    async def complete(
        self, prompt: list[dict[str, Any]] | ProcessedPrompt, params: SamplingParams, request_id: str,
        constraint_param: str | None = None, arrived: float | None = None,
    ) -> Finished:
        """Run a request to its end (within the request timeout); its latencies count from `arrived`
        (`arrival(request)`; default: now)."""
        started = arrived if arrived is not None else time.perf_counter()
        first_token: float | None = None
        final: RequestOutput | None = None
        try:
            async with asyncio.timeout(self.settings.request_timeout_s):
                # only the final output is kept: after a failed step the request may run again from its start
                async for output in self.outputs(prompt, params, request_id, constraint_param, restartable=True):
                    if first_token is None and output.token_ids:
                        first_token = time.perf_counter() - started
                    final = output
        except TimeoutError:
            raise self.timeout_error() from None
        assert final is not None and final.finished
        return self.record(final, first_token, started)

    def record(self, final: RequestOutput, first_token: float | None, started: float) -> Finished:
        seconds = time.perf_counter() - started
        self.metrics.observe_finished(final.num_prompt_tokens, len(final.token_ids), final.finish_reason or "stop",
                                      first_token, seconds)
        return Finished(final, first_token, seconds)

    def timeout_error(self) -> APIError:
        return APIError(408, f"the request did not finish within {self.settings.request_timeout_s} s and was aborted",
                        type="timeout_error", code="request_timeout")


# how long past its deadline a stream may still wait for its client to take the last events
# (the timeout's error event and [DONE]); a client that reads takes them at once
STREAM_SEND_GRACE_S = 5.0


class _StalledClient(Exception):
    pass


class StreamWithDeadline(StreamingResponse):
    """A streaming response that gives up on a client that stops reading. Its socket buffers
    full, a send waits for ever: before, such a stream ignored `request_timeout_s` and held its
    place in the service (429 for everyone else) until the client read again. A send still
    waiting `STREAM_SEND_GRACE_S` after `deadline` (the event loop's clock) ends the stream:
    `on_stalled()` runs, the events are closed (their request aborted, their place released),
    and the connection is dropped."""

    def __init__(self, content: AsyncIterator[str], deadline: float, on_stalled: Callable[[], None],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.deadline = deadline
        self.on_stalled = on_stalled

    async def __call__(self, scope, receive, send) -> None:
        async def bounded_send(message) -> None:
            try:
                async with asyncio.timeout_at(self.deadline + STREAM_SEND_GRACE_S):
                    await send(message)
            except TimeoutError:
                raise _StalledClient() from None

        try:
            await super().__call__(scope, receive, bounded_send)
        except _StalledClient:
            self.on_stalled()
            await self.body_iterator.aclose()
            if self.background is not None:
                await self.background()


async def until_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work()`; if the client disconnects first, cancel it (aborting its engine requests)
    and raise `ClientDisconnected`. Call only after the request body has been read."""

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected()
    return task.result()
