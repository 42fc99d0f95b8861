"""Read a request's body within bounds: size, time, and the service's capacity.

* A declared `Content-Length` over `max_body_bytes` is answered 413 at once,
  unread; a body without one (chunked) is counted as it arrives and fails the
  read once it passes the limit.
* The body must arrive within `timeout_s` of the request (`request_timeout_s`):
  one announced and never sent, or trickled a byte a second, held a connection
  and its memory for ever. Past that the read fails with 408.
* A client that goes away while sending its body is a `client_disconnected`,
  not a bug (Starlette's `ClientDisconnect` reached the catch-all as a 500).
* A generation request that finds the service full (`refuse_early`) is answered
  429 before its body is read, so a burst of large bodies costs no memory.

Every request's arrival (`time.perf_counter()`) is stamped in `scope["state"]`
(`request.state.arrived`): the latency metrics count from it, body reading,
parsing and image decoding included.

A failed read raises `BodyReadFailed` inside the app; whatever the app answers
then is replaced by this middleware's answer, given once and counted once.
After the body, `receive` is the server's own (disconnect watching is untimed).

(FastAPI's own `max_body_size` answers a plain-text 413; the service promises
OpenAI-style JSON error bodies for every error, hence this middleware.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vlm_catalog.server.errors import (
    CLIENT_CLOSED_REQUEST,
    APIError,
    BodyReadFailed,
    log_client_closed,
)


class RequestBodyGuard:
    def __init__(self, app: ASGIApp, max_body_bytes: int, timeout_s: float, count_error: Callable[[str], None],
                 refuse_early: Callable[[Scope], APIError | None] = lambda scope: None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s
        self.count_error = count_error
        self.refuse_early = refuse_early

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_body_bytes} bytes", code="body_too_large")

    def _too_slow(self) -> APIError:
        return APIError(408, f"the request body did not arrive within {self.timeout_s} s", type="timeout_error",
                        code="request_timeout")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["arrived"] = time.perf_counter()
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._answer(BodyReadFailed(self._too_large()), scope, receive, send)
            return
        early = self.refuse_early(scope)
        if early is not None:
            await self._answer(BodyReadFailed(early), scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        received = 0
        complete = False
        failure: BodyReadFailed | None = None

        def fail(error: APIError | None) -> BodyReadFailed:
            nonlocal failure
            failure = BodyReadFailed(error)
            return failure

        async def guarded_receive() -> Message:
            nonlocal received, complete
            if complete:
                return await receive()
            if failure is not None:  # the app reads again after a failed read (its own error handling)
                raise failure
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise fail(self._too_slow()) from None
            if message["type"] == "http.disconnect":
                raise fail(None)
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise fail(self._too_large())
                complete = not message.get("more_body", False)
            return message

        async def guarded_send(message: Message) -> None:
            if failure is None:
                await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except BodyReadFailed:
            if failure is None:
                raise
        if failure is not None:
            await self._answer(failure, scope, receive, send)

    async def _answer(self, failure: BodyReadFailed, scope: Scope, receive: Receive, send: Send) -> None:
        if failure.error is None:
            self.count_error("client_disconnected")
            log_client_closed(scope)
            response = Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it
        else:
            self.count_error(failure.error.code)
            response = failure.error.response()
        # the body was not read to its end: the connection cannot serve another request, and kept
        # alive it would wait for ever on a client that goes on trickling bytes
        response.headers["Connection"] = "close"
        await response(scope, receive, send)
