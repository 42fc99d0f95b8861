"""`POST /v1/extract` (one product, JSON or multipart with the image as a file) and `/v1/extract/batch`.

A product goes the way `LLM.extract` takes it: a `schemas.ProductRecord`, the
benchmark's prompt (`preprocess.prompt.build_messages`), and decoding
constrained by the per-record schema whose `category` is an enum of the
record's candidates (`structured.catalogue_schema`). The answer:

    {"id", "record_id", "metadata", "raw", "finish_reason", "usage", "timings"}

`metadata` is the validated answer; if the answer does not validate (e.g. it
was cut by `max_tokens`) it is null and `error` says why. A batch answers in
input order, each product either such an object or `{"error": {...}}` with its
own `status`: one bad product fails alone.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser

from vlm_catalog.engine.outputs import context_cut
from vlm_catalog.engine.sampling_params import SamplingParams
from vlm_catalog.server.chat import usage
from vlm_catalog.server.errors import (
    APIError,
    bad_request,
    from_pydantic,
    json_body_error,
    json_problem,
    validation_error,
)
from vlm_catalog.server.generation import Finished, arrival, new_request_id, until_disconnected
from vlm_catalog.server.protocol import ExtractBatchRequest, ExtractRequest
from vlm_catalog.server.state import ServiceState, check_text, service

router = APIRouter()

MULTIPART_FIELDS = 16  # form fields a product can have
LIST_FIELDS = ("candidate_categories",)
NUMBER_FIELDS = {"max_tokens": int, "seed": int, "temperature": float, "top_p": float}

EXTRACT_BODY = {
    "requestBody": {
        "content": {
            "application/json": {"schema": ExtractRequest.model_json_schema(by_alias=True)},
            "multipart/form-data": {"schema": {"type": "object", "description": (
                "the same fields; the image as a file part named 'image'; candidate_categories as a JSON "
                "list or repeated fields")}},
        },
        "required": True,
    }
}


@router.post("/v1/extract", openapi_extra=EXTRACT_BODY)
async def extract(request: Request):
    state = service(request)
    fields = await _read_product(request, state)
    with state.gateway.admit():
        product = _validated(fields)
        prepared = await _prepare(state, product, param_prefix="")
        result = await until_disconnected(request, lambda: _run(state, product, *prepared, arrival(request)))
    return JSONResponse(result)


@router.post("/v1/extract/batch")
async def extract_batch(body: ExtractBatchRequest, request: Request):
    state = service(request)
    limit = state.settings.max_batch_products
    if len(body.products) > limit:
        raise bad_request(f"the batch has {len(body.products)} products; at most {limit} are allowed",
                          param="products", code="batch_too_large")
    if len(body.products) > state.gateway.capacity:  # a 429 would never turn into a 200 on retry
        raise bad_request(
            f"the batch has {len(body.products)} products; this service holds at most {state.gateway.capacity} "
            "requests at once (max_num_seqs + max_waiting_requests), so send at most that many per call",
            param="products", code="batch_too_large",
        )
    with state.gateway.admit(len(body.products)):
        results = await until_disconnected(
            request, lambda: asyncio.gather(*(_one_of_batch(state, i, p, arrival(request))
                                              for i, p in enumerate(body.products)))
        )
    return JSONResponse({"results": results})


async def _one_of_batch(state: ServiceState, index: int, fields: Any, arrived: float) -> dict[str, Any]:
    prefix = f"products.{index}."
    try:
        if not isinstance(fields, dict):
            raise bad_request(f"products.{index} must be an object", param=f"products.{index}")
        try:
            product = ExtractRequest.model_validate(fields)
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
            for error in errors:
                error["loc"] = ("products", index, *error["loc"])
            raise validation_error(errors) from None
        return await _run(state, product, *await _prepare(state, product, prefix), arrived)
    except APIError as error:
        state.metrics.count_error(error.code)
        return {"status": error.status, **error.body()}


# ------------------------------------------------------------------ parsing
async def _read_product(request: Request, state: ServiceState) -> dict[str, Any]:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "multipart/form-data":
        return await _read_multipart(request, state)
    body = await request.body()
    try:
        fields = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:  # the last: a 500 before
        raise json_body_error(exc) from None
    if not isinstance(fields, dict):
        raise bad_request("the request body must be a JSON object (one product)")
    return fields


class StrictTextParts(MultiPartParser):
    """Starlette's multipart parser, but a text field that is not valid in the form's charset
    (UTF-8 unless the request names another) is refused. Starlette reads such a field as Latin-1:
    one stray cp1252 byte in scraped text made a whole field mojibake ("CafÃ©"), answered 200."""

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is None:
            try:
                bytes(part.data).decode(self._charset)
            except UnicodeDecodeError as exc:
                raise MultiPartException(f"field {part.field_name!r} is not valid {self._charset} text "
                                         f"(byte {exc.start}: {exc.reason})") from None
        super().on_part_end()


async def _read_multipart(request: Request, state: ServiceState) -> dict[str, Any]:
    try:
        form = await StrictTextParts(request.headers, request.stream(), max_files=1, max_fields=MULTIPART_FIELDS,
                                     max_part_size=state.settings.max_text_field_bytes).parse()
    except (MultiPartException, HTTPException) as exc:  # inside an app, Starlette raises the second for the first
        message = exc.message if isinstance(exc, MultiPartException) else exc.detail
        raise bad_request(f"cannot read the multipart form: {message}", code="invalid_multipart") from None
    fields: dict[str, Any] = {}
    try:
        for name in form:
            values = form.getlist(name)
            if name == "image":
                upload = values[0]
                if not isinstance(upload, UploadFile):
                    raise bad_request("image must be a file part", param="image")
                raw = await upload.read()
                encoded = await asyncio.get_running_loop().run_in_executor(None, base64.b64encode, raw)
                fields["image"] = encoded.decode("ascii")
            elif name in LIST_FIELDS:
                fields[name] = _form_list(name, values)
            elif name in NUMBER_FIELDS:
                fields[name] = _form_number(name, values[0])
            else:
                fields[name] = values[0] if isinstance(values[0], str) else values[0].filename
    finally:
        await form.close()
    return fields


def _form_list(name: str, values: list[Any]) -> list[Any]:
    if len(values) == 1 and isinstance(values[0], str) and values[0].lstrip().startswith("["):
        try:
            return json.loads(values[0])
        except (json.JSONDecodeError, RecursionError) as exc:
            raise bad_request(f"{name} is not a JSON list: {json_problem(exc)}", param=name) from None
    return list(values)


def _form_number(name: str, value: Any) -> int | float:
    try:
        return NUMBER_FIELDS[name](value)
    except (TypeError, ValueError):
        raise bad_request(f"{name} must be a number, got {value!r}", param=name) from None


def _validated(fields: dict[str, Any]) -> ExtractRequest:
    try:
        return ExtractRequest.model_validate(fields)
    except ValidationError as exc:
        raise from_pydantic(exc) from None


# --------------------------------------------------------------- extraction
async def _prepare(state: ServiceState, product: ExtractRequest, param_prefix: str):
    """Check the product; build its record, processed prompt and sampling params (the heavy part in a thread)."""
    from schemas import ProductRecord, SchemaError, resolve_schema
    from vlm_catalog.preprocess.prompt import PromptError
    from vlm_catalog.structured import GrammarError

    for name in ("title", "description", "id"):
        if getattr(product, name) is not None:
            check_text(state, getattr(product, name), param_prefix + name)
    for index, category in enumerate(product.candidate_categories):
        check_text(state, category, f"{param_prefix}candidate_categories.{index}")
    try:
        schema = resolve_schema(product.schema_)
    except SchemaError as exc:
        raise bad_request(str(exc), param=param_prefix + "schema", code="unknown_schema") from None
    if schema.model is None:
        raise bad_request("schema must name a registered pydantic schema", param=param_prefix + "schema")
    # base64 decoding in a worker thread (a 27 MB image stalled the event loop, /health too, by 130 ms)
    reference = await asyncio.get_running_loop().run_in_executor(
        None, _image_reference, product.image, param_prefix + "image")
    image = await state.images.bytes_of(reference, param_prefix + "image")
    try:
        record = ProductRecord(
            id=product.id, title=product.title, description=product.description, image=image,
            candidate_categories=product.candidate_categories,
        )
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        for error in errors:
            error["loc"] = (*_loc(param_prefix), *error["loc"])
        raise validation_error(errors) from None
    loop = asyncio.get_running_loop()
    try:
        max_tokens = product.max_tokens or state.settings.extract_max_tokens
        prompt, constrained, max_tokens = await loop.run_in_executor(
            None, _prompt_and_schema, record, product, schema.model, max_tokens, state.engine.engine
        )
    except GrammarError as exc:  # candidates the per-record schema cannot take
        raise bad_request(str(exc), param=param_prefix + "candidate_categories", code="invalid_product") from None
    except PromptError as exc:
        raise bad_request(str(exc), param=param_prefix + "image", code="invalid_product") from None
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if product.temperature is None else product.temperature,
            top_p=1.0 if product.top_p is None else product.top_p,
            seed=product.seed,
            json_schema=constrained,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return prompt, params, schema


def _loc(param_prefix: str) -> tuple[str, ...]:
    """`"products.3."` -> `("products", "3")`; `""` -> `()`."""
    return tuple(param_prefix.rstrip(".").split(".")) if param_prefix else ()


def _image_reference(image: str, param: str) -> str | bytes:
    """A URI (data:, http(s):, anything with a scheme) as given, for the image rules; else base64 of the file.
    (Base64 has no ':', so a colon near the start means a URI.)"""
    if ":" in image[:32]:
        return image
    try:
        return base64.b64decode("".join(image.split()), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param} is neither a data:image/...;base64 URI nor valid base64", param=param,
                          code="image_bad_base64") from None


def _prompt_and_schema(record, product: ExtractRequest, model, max_tokens: int, engine):
    """The processed prompt, the per-record schema (bounded when the budget is tight, so the answer
    always completes: `structured.catalogue.record_schema`) and the budget to run it with: `max_tokens`,
    or what the context leaves after the prompt when that is less."""
    from vlm_catalog.preprocess.prompt import build_messages
    from vlm_catalog.structured.catalogue import record_schema, token_counter

    count_tokens = token_counter(engine.tokenizer)

    messages = build_messages(record, style=product.prompt_style, schema=model)
    try:
        prompt = engine.processor.process(messages)
    except ValueError as exc:  # ImageDecodeError, PromptError: refused as the engine refuses them
        raise APIError(400, str(exc), code="invalid_prompt") from None
    constrained, budget, _ = record_schema(
        record.candidate_categories, max_tokens, count_tokens, model, answer_room=engine.answer_room(prompt)
    )
    return prompt, constrained, budget


async def _run(state: ServiceState, product: ExtractRequest, prompt, params, schema, arrived: float) -> dict[str, Any]:
    from schemas import AnswerValidationError

    request_id = new_request_id("extract")
    finished: Finished = await state.gateway.complete(prompt, params, request_id, arrived=arrived)
    output = finished.output
    metadata, error = None, None
    try:
        params.json_schema.validate(output.text)  # the per-record schema: category among the candidates
        metadata = schema.validate(output.text).model_dump(mode="json")
    except AnswerValidationError as exc:
        cut_by_context = context_cut(output, state.engine.engine.config.max_model_len)
        reason = f"finish_reason {output.finish_reason}" + (f": {cut_by_context}" if cut_by_context else "")
        error = f"the answer does not validate against {schema.name} ({reason}): {exc}"
    metrics = output.metrics
    result = {
        "id": request_id,
        "record_id": product.id,
        "metadata": metadata,
        "raw": output.text,
        "finish_reason": output.finish_reason,
        "usage": usage(output),
        "timings": {
            "queue_seconds": metrics.get("queue_time"),
            "time_to_first_token_seconds": finished.time_to_first_token,
            "total_seconds": finished.seconds,
        },
    }
    if error is not None:
        result["error"] = error
    return result
