"""`GET /v1/models`, `GET /health` and `GET /metrics`."""

from __future__ import annotations

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
    """200 while the engine thread runs; 503 once it has stopped or died (open without the API key)."""
    if service(request).engine.is_running:
        return {"status": "ok"}
    return JSONResponse({"status": "engine not running"}, status_code=503)
