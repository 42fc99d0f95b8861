"""Bearer-token authentication: with an API key set, every route but `/health` needs it.

An ASGI middleware, so the check comes before anything reads the request (a
request without the key learns nothing, not even whether its body parses).
The key is compared in constant time and never logged or echoed.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from vlm_catalog.server.errors import APIError

OPEN_PATHS = frozenset({"/health"})


class ApiKeyAuth:
    def __init__(self, app: ASGIApp, api_key: str, count_error) -> None:
        self.app = app
        self._key = api_key.encode()
        self.count_error = count_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorised(scope):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                         type="authentication_error", code="invalid_api_key",
                         headers={"WWW-Authenticate": "Bearer"})
        self.count_error(error.code)
        await error.response()(scope, receive, send)

    def _authorised(self, scope: Scope) -> bool:
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._key)
