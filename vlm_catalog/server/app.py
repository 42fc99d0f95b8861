"""`create_app(engine, settings)`: the FastAPI application over one `AsyncLLM`.

The engine runs in its own thread (`AsyncLLM`); the event loop only parses,
checks and routes. Base64 decoding, image header probing, prompt building and
tokenisation run in worker threads, so a large request never stalls the others.

    engine = AsyncLLM(model=DEFAULT_MODEL_DIR)
    app = create_app(engine, ServerSettings())
    uvicorn.run(app)          # or `vlm-catalog serve`

The app does not own the engine: whoever created it shuts it down.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
from fastapi import FastAPI
from fastapi.responses import Response

from vlm_catalog.engine.async_engine import AsyncLLM
from vlm_catalog.engine.generation_config import generation_config_sampling
from vlm_catalog.server import chat, extract, info
from vlm_catalog.server.auth import ApiKeyAuth
from vlm_catalog.server.body_guard import RequestBodyGuard
from vlm_catalog.server.errors import (
    CLIENT_CLOSED_REQUEST,
    APIError,
    install_error_handlers,
    log_client_closed,
)
from vlm_catalog.server.generation import ClientDisconnected, EngineGateway
from vlm_catalog.server.images import ImageResolver
from vlm_catalog.server.metrics import ServiceMetrics
from vlm_catalog.server.settings import ServerSettings
from vlm_catalog.server.state import ServiceState

# the endpoints that take places in the service: a full service answers them 429 before their body is read
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/extract", "/v1/extract/batch"})


def create_app(engine: AsyncLLM, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    model_dir = engine.engine.config.model

    def load_stats() -> dict[str, float]:
        places = {"requests_in_service": state.gateway.in_flight, "service_capacity": state.gateway.capacity}
        return {**engine.load_stats(), **places}

    metrics = ServiceMetrics(load_stats)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        client = None
        if settings.allowed_image_hosts:
            client = httpx.AsyncClient(timeout=settings.image_fetch_timeout_s, follow_redirects=False, trust_env=False)
            state.images.client = client
        try:
            yield
        finally:
            if client is not None:
                await client.aclose()

    app = FastAPI(title="vlm-catalog", summary="Product metadata extraction service", lifespan=lifespan)
    state = ServiceState(
        engine=engine,
        settings=settings,
        metrics=metrics,
        gateway=EngineGateway(engine, settings, metrics),
        images=ImageResolver(settings),
        model_name=settings.served_model_name or Path(model_dir).resolve().name,  # `--model .` has no name
        default_sampling=generation_config_sampling(model_dir),
    )
    app.state.service = state
    install_error_handlers(app, metrics.count_error)

    async def client_disconnected(request, exc: ClientDisconnected) -> Response:
        metrics.count_error("client_disconnected")
        log_client_closed(request.scope)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    app.add_exception_handler(ClientDisconnected, client_disconnected)
    for router in (info.router, chat.router, extract.router):
        app.include_router(router)

    def refuse_early(scope) -> APIError | None:
        if scope["method"] == "POST" and scope["path"] in GENERATION_PATHS:
            return state.gateway.busy_error()
        return None

    app.add_middleware(RequestBodyGuard, max_body_bytes=settings.max_body_bytes, timeout_s=settings.request_timeout_s,
                       count_error=metrics.count_error, refuse_early=refuse_early)
    if settings.api_key is not None:  # outermost: nothing is read before the key is checked
        app.add_middleware(ApiKeyAuth, api_key=settings.api_key.get_secret_value(), count_error=metrics.count_error)
    return app
