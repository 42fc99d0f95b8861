"""Slow and vanishing clients: bodies that never finish, streams nobody reads, uploads cut off,
and bursts at a full service (`server/body_guard.py`, `generation.StreamWithDeadline`)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from tests.server.conftest import (
    MODEL_NAME,
    LiveServer,
    asgi_scope,
    body_then_stay,
    call,
    chat_body,
    error_counts,
    wait_until,
)
from vlm_catalog.server import ServerSettings, create_app


async def stalling_body(first: bytes, stall_s: float = 30.0):
    """A body that sends `first`, then nothing for `stall_s`."""
    yield first
    await asyncio.sleep(stall_s)
    yield b"}"


@pytest.mark.parametrize("path,content_type", [
    ("/v1/chat/completions", "application/json"),
    ("/v1/extract", "application/json"),
    ("/v1/extract", "multipart/form-data; boundary=xyz"),
])
def test_a_body_that_stops_arriving_is_408_at_the_request_timeout(engine, path, content_type):
    """Before, a body announced and never finished held its connection and memory for ever."""
    app = create_app(engine, ServerSettings(request_timeout_s=0.5))
    first = b'--xyz\r\nContent-Disposition: form-data; name="title"\r\n\r\nLamp' if "multipart" in content_type \
        else b'{"model": "' + MODEL_NAME.encode() + b'", "messages": ['
    started = time.monotonic()
    response = call(app, "POST", path, content=stalling_body(first), headers={"content-type": content_type})
    assert time.monotonic() - started < 5
    assert response.status_code == 408 and response.json()["error"]["code"] == "request_timeout", response.text
    assert response.headers["connection"] == "close"  # kept alive, a client trickling on held it for ever
    assert "did not arrive within 0.5 s" in response.json()["error"]["message"]
    assert error_counts(app) == {"request_timeout": 1.0}  # once: not also FastAPI's 400, or a 500


def test_a_full_service_answers_429_before_reading_the_body(engine):
    """Before, a request over capacity was read and parsed whole before its 429: twenty 20 MB
    bodies at a full service took 450 MB."""
    app = create_app(engine, ServerSettings())
    gateway = app.state.service.gateway
    gateway.in_flight = gateway.capacity
    try:
        started = time.monotonic()
        for path in ("/v1/chat/completions", "/v1/extract", "/v1/extract/batch"):
            response = call(app, "POST", path, content=stalling_body(b"{"), headers={"content-type": "application/json"})
            assert response.status_code == 429 and response.headers["Retry-After"], response.text
            assert response.json()["error"]["code"] == "server_busy"
        assert time.monotonic() - started < 5  # not one stalled body was waited for
        assert call(app, "GET", "/health").status_code == 200
    finally:
        gateway.in_flight = 0
    assert error_counts(app) == {"server_busy": 3.0}
    assert call(app, "POST", "/v1/chat/completions", json=chat_body()).status_code == 200


def test_an_upload_cut_off_midway_is_a_client_disconnect_not_a_bug(engine, caplog):
    """Before, /v1/extract logged "unhandled error" with a ClientDisconnect traceback and counted
    an internal_error (a bug); the chat endpoint counted FastAPI's 400."""
    app = create_app(engine, ServerSettings())
    with LiveServer(app) as live:
        port = int(live.url.rsplit(":", 1)[1])
        for path in ("/v1/extract", "/v1/chat/completions"):
            with socket.create_connection(("127.0.0.1", port)) as connection:
                connection.sendall(f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                                   "Content-Length: 10000\r\n\r\n{\"title\": ".encode())
                time.sleep(0.2)
        assert wait_until(lambda: error_counts(app).get("client_disconnected") == 2.0), error_counts(app)
    assert error_counts(app) == {"client_disconnected": 2.0}
    assert "unhandled error" not in caplog.text


def test_a_stream_nobody_reads_ends_at_the_request_timeout_and_frees_its_place(engine, monkeypatch):
    """A client whose socket stops taking data blocks the stream's sends for ever (uvicorn's send
    waits for the buffers to drain). Before, the stream ignored request_timeout_s and kept its
    place: every other request got 429 until the client read again."""
    from vlm_catalog.server import generation

    monkeypatch.setattr(generation, "STREAM_SEND_GRACE_S", 0.2)
    app = create_app(engine, ServerSettings(request_timeout_s=1.0))
    gateway = app.state.service.gateway
    body = json.dumps(chat_body(max_tokens=2000, stream=True, ignore_eos=True)).encode()
    chunks_sent = 0
    receive = body_then_stay(body)  # the client never leaves

    async def send(message):
        nonlocal chunks_sent
        if message["type"] == "http.response.body":
            chunks_sent += 1
            if chunks_sent >= 3:
                await asyncio.Event().wait()  # the peer's window is closed: the write never drains

    scope = asgi_scope("/v1/chat/completions", body)

    async def run() -> float:
        started = time.monotonic()
        await asyncio.wait_for(app(scope, receive, send), timeout=20)
        return time.monotonic() - started

    seconds = asyncio.run(run())
    assert 1.0 <= seconds < 5 and chunks_sent == 3
    assert gateway.in_flight == 0
    assert error_counts(app) == {"request_timeout": 1.0}
    assert wait_until(lambda: engine.load_stats()["requests_running"] == 0)  # its engine request aborted
    assert call(app, "POST", "/v1/chat/completions", json=chat_body()).status_code == 200


def test_an_extract_image_is_decoded_off_the_event_loop(engine, records, monkeypatch):
    """docs/service.md's promise: base64 decoding runs in worker threads. Before, /v1/extract's
    raw base64 (and a multipart upload's encoding) ran on the loop: a 27 MB image stalled every
    other request, /health too, by 130 ms."""
    import threading

    from tests.server.conftest import product_json
    from vlm_catalog.server import extract

    threads = []
    real = extract._image_reference
    monkeypatch.setattr(extract, "_image_reference",
                        lambda *args: threads.append(threading.current_thread()) or real(*args))
    app = create_app(engine, ServerSettings())
    response = call(app, "POST", "/v1/extract", json=product_json(records[0]))
    assert response.status_code == 200, response.text
    assert threads and threads[0] is not threading.main_thread()
