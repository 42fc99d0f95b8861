"""`GET /v1/models`, `GET /health` and `GET /metrics`."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from vlm_catalog.server.state import check_model, service

router = APIRouter()

STARTED = int(time.time())


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": STARTED, "owned_by": "vlm-catalog"}


@router.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": [_model_card(service(request).model_name)]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request):
    state = service(request)
    check_model(state, model)
    return _model_card(state.model_name)


@router.get("/metrics")
async def metrics(request: Request):
    return Response(service(request).metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@router.get("/health")
async def health(request: Request):
    """200 while the engine serves; 503 once its thread has stopped or died, while its last steps
    have all failed (a dead device: a one-token probe then shows whether it is back), or while a step
    has run longer than `health_step_timeout_s` (a hung one). Open without the API key."""
    state = service(request)
    engine, timeout = state.engine, state.settings.health_step_timeout_s
    problem = engine.health(timeout)
    if problem is not None and engine.is_running and engine.steps_failing:
        try:
            await asyncio.wait_for(engine.probe(), timeout)
        except TimeoutError:
            pass
        problem = engine.health(timeout)
    if problem is None:
        return {"status": "ok"}
    return JSONResponse({"status": problem}, status_code=503)
