"""What every route needs, kept on `app.state.service`, and the small checks they share."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from vlm_catalog.engine.async_engine import AsyncLLM
from vlm_catalog.engine.generation_config import Sampling
from vlm_catalog.server.errors import APIError, bad_request
from vlm_catalog.server.generation import EngineGateway
from vlm_catalog.server.images import ImageResolver
from vlm_catalog.server.metrics import ServiceMetrics
from vlm_catalog.server.settings import ServerSettings


@dataclass
class ServiceState:
    engine: AsyncLLM
    settings: ServerSettings
    metrics: ServiceMetrics
    gateway: EngineGateway
    images: ImageResolver
    model_name: str
    default_sampling: Sampling  # the checkpoint's generation_config.json: used where a request names none


def service(request: Request) -> ServiceState:
    return request.app.state.service


def check_model(state: ServiceState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")


def check_text(state: ServiceState, text: str, param: str) -> str:
    """`text` if it is valid Unicode (JSON's `\\ud800` escapes can carry lone surrogates) and fits the
    per-field limit (in UTF-8 bytes); 400 naming the field otherwise."""
    limit = state.settings.max_text_field_bytes
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise bad_request(f"{param} contains an unpaired surrogate {text[exc.start]!r} at character {exc.start} "
                          "(not valid Unicode)", param=param, code="invalid_unicode") from None
    if size > limit:
        raise bad_request(f"{param} is {size} bytes; at most {limit} are allowed", param=param, code="text_too_long")
    return text
