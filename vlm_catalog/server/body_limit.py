"""Refuse request bodies over `max_body_bytes` with 413, before they fill memory.

A declared `Content-Length` over the limit is answered at once, unread. A body
without one (chunked) is counted as it arrives; once it passes the limit, the
read fails and whatever the app would have answered is replaced by the 413.

(FastAPI's own `max_body_size` answers a plain-text 413; the service promises
OpenAI-style JSON error bodies for every error, hence this middleware.)
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vlm_catalog.server.errors import APIError


class BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_body_bytes: int, count_error) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.count_error = count_error

    def _error(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_body_bytes} bytes",
                        code="body_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._send_error(scope, receive, send)
            return
        received = 0
        too_large = False

        async def counting_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    too_large = True
                    raise BodyTooLarge()
            return message

        replaced = False

        async def guarded_send(message: Message) -> None:
            nonlocal replaced
            if too_large:  # the app failed reading the body: answer 413 instead of its reply
                if not replaced:
                    replaced = True
                    await self._send_error(scope, receive, send)
                return
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except BodyTooLarge:
            if not replaced:
                await self._send_error(scope, receive, send)

    async def _send_error(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = self._error()
        self.count_error(error.code)
        await error.response()(scope, receive, send)
