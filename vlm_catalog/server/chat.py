"""`POST /v1/chat/completions`: OpenAI-compatible, plain and streaming (server-sent events).

The request is checked completely before the engine sees it: model name, message
shapes and roles, text sizes, image count and images (see `images.py`),
sampling ranges, and the response format (a JSON schema is resolved and
meta-validated; a regex is compiled by the engine's grammar compiler, and a
failure there is still a 400). A streaming request's headers are sent only once
its first output exists, so every refusal is a proper 4xx response rather than
an error inside a 200 stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.background import BackgroundTask

from vlm_catalog.engine.outputs import RequestOutput
from vlm_catalog.engine.sampling_params import SamplingParams, SamplingParamsError
from vlm_catalog.server.errors import APIError, bad_request, error_json
from vlm_catalog.server.generation import (
    Admission,
    StreamWithDeadline,
    arrival,
    new_request_id,
    until_disconnected,
)
from vlm_catalog.server.images import refuse_too_many_images
from vlm_catalog.server.protocol import ChatCompletionRequest, ImagePart, unsupported_fields
from vlm_catalog.server.state import ServiceState, check_model, check_text, service

logger = logging.getLogger(__name__)
router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = service(request)
    check_model(state, body.model)
    refused = unsupported_fields(body)
    if refused:
        raise bad_request(f"{refused[0]} is not supported by this server", param=refused[0], code="unsupported_field")
    if body.n not in (None, 1):
        raise bad_request("only n=1 is supported", param="n")
    if body.stream_options is not None and not body.stream:  # as OpenAI's API answers
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    admission = state.gateway.admit()
    streaming = False
    try:
        messages = await engine_messages(state, body)
        params = await sampling_params(state, body)
        request_id = new_request_id("chatcmpl")
        if body.stream:
            response = await _stream(request, state, body, messages, params, request_id, admission)
            streaming = True  # the stream releases its place when it ends
            return response
        finished = await until_disconnected(
            request, lambda: state.gateway.complete(messages, params, request_id, constraint_param(params),
                                                    arrival(request))
        )
    finally:
        if not streaming:
            admission.release()
    output = finished.output
    return JSONResponse({
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": output.text},
            "logprobs": None,
            "finish_reason": output.finish_reason,
        }],
        "usage": usage(output),
    })


def usage(output: RequestOutput) -> dict[str, Any]:
    completion = len(output.token_ids)
    return {
        "prompt_tokens": output.num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": output.num_prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": int(output.metrics.get("num_cached_tokens", 0))},
    }


async def engine_messages(state: ServiceState, body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the prompt processor takes them, images as checked file bytes."""
    image_count = sum(
        isinstance(part, ImagePart) for message in body.messages if isinstance(message.content, list)
        for part in message.content
    )
    refuse_too_many_images(image_count, state.settings)
    messages = []
    for index, message in enumerate(body.messages):
        role = "system" if message.role == "developer" else message.role
        where = f"messages.{index}.content"
        if isinstance(message.content, str):
            messages.append({"role": role, "content": check_text(state, message.content, where)})
            continue
        parts = []
        for part_index, part in enumerate(message.content):
            if isinstance(part, ImagePart):
                raw = await state.images.bytes_of(part.url, f"{where}.{part_index}.image_url.url")
                parts.append({"type": "image", "image": raw})
            else:
                parts.append({"type": "text", "text": check_text(state, part.text, f"{where}.{part_index}.text")})
        messages.append({"role": role, "content": parts})
    return messages


async def sampling_params(state: ServiceState, body: ChatCompletionRequest) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > state.settings.max_stop_strings:
        raise bad_request(f"at most {state.settings.max_stop_strings} stop strings are allowed", param="stop")
    for index, text in enumerate(stop):
        check_text(state, text, f"stop.{index}")
    constraint: dict[str, Any] = {}
    response_format = body.response_format
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            constraint["json_schema"] = {"type": "object"}
        elif response_format.json_schema is None:
            raise bad_request("response_format of type json_schema needs a json_schema object",
                              param="response_format.json_schema", code="missing_field")
        else:
            constraint["json_schema"] = response_format.json_schema.schema_
        if body.guided_regex is not None:
            raise bad_request("give either response_format or guided_regex, not both", param="guided_regex")
    elif body.guided_regex is not None:
        constraint["regex"] = check_text(state, body.guided_regex, "guided_regex")
    if constraint:
        constraint = await _checked_constraint(constraint)
    defaults = state.default_sampling
    try:
        return SamplingParams(
            max_tokens=body.max_completion_tokens or body.max_tokens or state.settings.default_max_tokens,
            temperature=defaults.temperature if body.temperature is None else body.temperature,
            top_p=defaults.top_p if body.top_p is None else body.top_p,
            top_k=defaults.top_k if body.top_k is None else body.top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            seed=body.seed,
            stop=stop,
            **constraint,
        )
    except SamplingParamsError as exc:
        # the request's field of the same name (max_tokens and the rest are bounded before they get here)
        raise bad_request(str(exc), param=exc.field) from None


CONSTRAINT_FIELDS = {"json_schema": "response_format.json_schema.schema", "regex": "guided_regex"}


def constraint_param(params: SamplingParams) -> str | None:
    """The request field that gave `params` its constraint (the field its compile errors name)."""
    return next((field for kind, field in CONSTRAINT_FIELDS.items() if getattr(params, kind) is not None), None)


async def _checked_constraint(constraint: dict[str, Any]) -> dict[str, Any]:
    """Resolve and meta-validate a JSON schema in a worker thread (400 naming what is wrong).

    The resolved `OutputSchema` replaces the dict, so the engine thread does not validate it again.
    """
    from vlm_catalog.structured import GrammarError, GrammarSpec

    param = CONSTRAINT_FIELDS["json_schema" if "json_schema" in constraint else "regex"]
    loop = asyncio.get_running_loop()
    try:
        spec = await loop.run_in_executor(None, lambda: GrammarSpec.from_request(**constraint))
    except GrammarError as exc:
        raise bad_request(str(exc), param=param, code="invalid_response_format") from None
    if spec.output_schema is not None:
        return {"json_schema": spec.output_schema}
    return constraint


# ------------------------------------------------------------------ streaming
async def _stream(request: Request, state: ServiceState, body: ChatCompletionRequest, messages, params,
                  request_id: str, admission: Admission) -> StreamWithDeadline:
    gateway = state.gateway
    started = arrival(request)
    deadline = asyncio.get_running_loop().time() + state.settings.request_timeout_s
    outputs = gateway.outputs(messages, params, request_id, constraint_param(params))

    async def first_output():
        async with asyncio.timeout_at(deadline):
            return await anext(outputs)

    try:  # refusals surface here, before any header is sent; a client gone meanwhile aborts it
        first = await until_disconnected(request, first_output)
    except TimeoutError:
        await outputs.aclose()
        raise gateway.timeout_error() from None
    except BaseException:
        await outputs.aclose()
        raise
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunk = _chunker(request_id, state.model_name, include_usage)
    stalled = False  # its client stopped reading (`StreamWithDeadline`)
    timed_out = False  # the timeout's error event was sent (and counted)
    recorded = False  # counted as finished: a client leaving after that is not counted again

    def on_stalled() -> None:
        nonlocal stalled
        stalled = True
        if not timed_out and not recorded:
            state.metrics.count_error("request_timeout")
        logger.warning("stream %s: its client stopped reading; dropped past the request timeout", request_id)

    async def events() -> AsyncIterator[str]:
        nonlocal timed_out, recorded
        first_token = time.perf_counter() - started if first.token_ids else None
        try:
            yield chunk({"role": "assistant", "content": ""})
            output = first
            while True:
                if output.delta_text:
                    yield chunk({"content": output.delta_text})
                if first_token is None and output.token_ids:
                    first_token = time.perf_counter() - started
                if output.finished:
                    break
                async with asyncio.timeout_at(deadline):
                    output = await anext(outputs)
            gateway.record(output, first_token, started)
            recorded = True
            yield chunk({}, finish_reason=output.finish_reason)
            if include_usage:
                yield chunk(None, usage=usage(output))
        except TimeoutError:
            timed_out = True
            yield _sse_error(gateway.timeout_error(), state)
        except APIError as error:
            yield _sse_error(error, state)
        except (asyncio.CancelledError, GeneratorExit):  # the client went away mid-stream, or stopped reading
            if not stalled and not recorded:
                state.metrics.count_error("client_disconnected")
            raise
        finally:
            admission.release()
            with contextlib.suppress(Exception):
                await outputs.aclose()  # a client that went away aborts its request here
        yield "data: [DONE]\n\n"

    # the place is released when the events end, or after the response if they never started
    return StreamWithDeadline(events(), deadline, on_stalled, media_type="text/event-stream",
                              background=BackgroundTask(admission.release),
                              headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _chunker(request_id: str, model: str, include_usage: bool):
    """Chunk builder. With `include_usage`, every chunk has a `usage` key, null but in the last (OpenAI's
    rule: clients read `chunk["usage"]`); without it, no chunk has one."""
    created = int(time.time())

    def chunk(delta: dict[str, Any] | None, finish_reason: str | None = None, usage: dict | None = None) -> str:
        payload: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                                   "model": model}
        if delta is None:
            payload["choices"] = []
        else:
            payload["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        if include_usage:
            payload["usage"] = usage
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    return chunk


def _sse_error(error: APIError, state: ServiceState) -> str:
    state.metrics.count_error(error.code)
    return f"data: {error_json(error)}\n\n"
