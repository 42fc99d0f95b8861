"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

Every refusal is an `APIError` carrying its HTTP status; the handlers installed
by `install_error_handlers` turn it, FastAPI's validation errors and unknown
routes into that body, and count each in `vlm_catalog_request_errors_total`
by `code`. An exception nobody expected is a bug: it is logged and answered
500 with a body of the same shape.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code or type
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# not a real HTTP status: nginx's "client closed request", only for logs and metrics
CLIENT_CLOSED_REQUEST = 499


def log_client_closed(scope) -> None:
    """One log line for a request whose client went away before its answer: the server drops a
    response sent after that, so its access log never shows one."""
    logger.info('"%s %s" %d: the client disconnected before its answer', scope.get("method"), scope.get("path"),
                CLIENT_CLOSED_REQUEST)


class BodyReadFailed(Exception):
    """The request's body could not be read (`body_guard.py`): `error` is the answer, None when
    the client went away."""

    def __init__(self, error: APIError | None) -> None:
        super().__init__(error.message if error is not None else "the client went away")
        self.error = error


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def error_json(error: APIError) -> str:
    return json.dumps(error.body())


# pydantic names the member of a union it tried in the error location; these are not fields
_UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "ImageURL", "TextPart", "ImagePart"})


def location(loc: tuple[Any, ...]) -> str | None:
    """The field path a client wrote: `("body", "messages", 0, "content", "str")` -> `"messages.0.content"`.

    Union member names (`"str"`, `"list[...]"`) are dropped, and so is the tag pydantic inserts
    after the index of an item of a tagged union (`..., "list[tagged-union[...]]", 0, "text", "text"`).
    """
    parts: list[str] = []
    skip_tag_after_index = False
    expect_tag = False
    for part in loc:
        if part == "body" and not parts:
            continue
        if isinstance(part, str) and ("[" in part or part in _UNION_MEMBERS):
            skip_tag_after_index = skip_tag_after_index or "tagged-union" in part
            continue
        if expect_tag:
            expect_tag = False
            continue
        if isinstance(part, int) and skip_tag_after_index:
            skip_tag_after_index, expect_tag = False, True
        parts.append(str(part))
    return ".".join(parts) or None


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """One 400 naming the most specific problem (the deepest; for a union, the form the client meant)."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                        code="invalid_json")
    first = max(errors, key=lambda error: len(error.get("loc", ())))
    param = location(tuple(first.get("loc", ())))
    message = f"{param}: {first['msg']}" if param else first["msg"]
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    code = "missing_field" if first.get("type") == "missing" else "invalid_value"
    return APIError(400, message, param=param, code=code)


def json_problem(exc: Exception) -> str:
    """What json's error says; its parser recurses once per level of nesting, so a RecursionError
    is JSON nested too deeply."""
    return "nested too deeply" if isinstance(exc, RecursionError) else str(exc)


def json_body_error(exc: Exception) -> APIError:
    """The 400 for a body json cannot read."""
    return APIError(400, f"the request body is not valid JSON: {json_problem(exc)}", code="invalid_json")


def from_pydantic(exc: ValidationError) -> APIError:
    return validation_error(exc.errors(include_url=False))


def install_error_handlers(app: FastAPI, count_error) -> None:
    """`count_error(code)` is called once per error answered."""

    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        count_error(exc.code)
        return exc.response()

    async def request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await api_error(request, validation_error(list(exc.errors())))

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, BodyReadFailed):  # FastAPI's 400 for any failed read: the guard answers
            raise exc.__cause__
        if exc.status_code == 400 and isinstance(exc.__cause__, (UnicodeDecodeError, RecursionError)):
            return await api_error(request, json_body_error(exc.__cause__))  # FastAPI says only "error parsing the body"
        codes = {404: "not_found", 405: "method_not_allowed"}
        error = APIError(exc.status_code, str(exc.detail), code=codes.get(exc.status_code, "http_error"),
                         headers=getattr(exc, "headers", None))
        return await api_error(request, error)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        error = APIError(500, f"internal server error ({type(exc).__name__}); this is a bug", type="server_error",
                         code="internal_error")
        return await api_error(request, error)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, request_validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
