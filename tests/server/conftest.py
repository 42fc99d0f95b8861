"""Service test fixtures: one engine on the shipped model per session, apps over it, helpers."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time

import httpx
import pytest
import uvicorn
from PIL import Image

from vlm_catalog.engine.async_engine import AsyncLLM
from vlm_catalog.paths import DEFAULT_MODEL_DIR, SAMPLE_CATALOGUE_DIR
from vlm_catalog.server import ServerSettings, create_app

MODEL_NAME = DEFAULT_MODEL_DIR.name


@pytest.fixture(scope="session")
def engine():
    engine = AsyncLLM(model=DEFAULT_MODEL_DIR)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def records():
    from vlm_catalog.data.loader import load_catalogue

    catalogue = load_catalogue(SAMPLE_CATALOGUE_DIR)
    return [catalogue[i] for i in range(len(catalogue))]


@pytest.fixture(scope="session")
def app(engine):
    return create_app(engine, ServerSettings())


def png_bytes(width: int = 40, height: int = 32, colour=(200, 40, 40)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def data_uri(raw: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(raw).decode('ascii')}"


def product_json(record) -> dict:
    return {
        "id": record.id,
        "title": record.title,
        "description": record.description,
        "candidate_categories": list(record.candidate_categories),
        "image": base64.b64encode(record.image).decode("ascii"),
    }


def chat_body(content="Describe the product.", **fields) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **fields}


def error_counts(app) -> dict[str, float]:
    """The app's `vlm_catalog_request_errors_total` by kind."""
    errors = app.state.service.metrics.request_errors
    return {sample.labels["kind"]: sample.value for metric in errors.collect() for sample in metric.samples
            if sample.name.endswith("_total")}


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


async def _requests(app, calls):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://service", timeout=120) as client:
        return await asyncio.gather(*(client.request(method, path, **kwargs) for method, path, kwargs in calls))


def call(app, method: str, path: str, **kwargs) -> httpx.Response:
    """One request to the app in-process."""
    return asyncio.run(_requests(app, [(method, path, kwargs)]))[0]


def call_many(app, calls) -> list[httpx.Response]:
    """Requests sent concurrently to the app in-process; answers in order."""
    return asyncio.run(_requests(app, calls))


class LiveServer:
    """A real uvicorn on 127.0.0.1 (a free port) in a background thread."""

    def __init__(self, app) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        assert wait_until(lambda: self.server.started, timeout=20), "uvicorn did not start"
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def load_is_zero(engine) -> bool:
    stats = engine.load_stats()
    return stats["requests_running"] == 0 and stats["requests_waiting"] == 0 and stats["kv_cache_usage_ratio"] == 0.0


def asgi_scope(path: str, body: bytes) -> dict:
    """An HTTP scope for driving an app's ASGI callable by hand (exact timing of receive and send)."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
            "headers": [(b"host", b"service"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())],
            "state": {}}


def body_then_stay(body: bytes):
    """An ASGI `receive`: the body in one message, then nothing (a client that never leaves)."""
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()

    return receive
