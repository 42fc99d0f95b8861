"""Bad traffic, in-process: a full service answers 429, slow requests time out, auth, a dead engine."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import httpx
import pytest

from tests.server.conftest import (
    MODEL_NAME,
    LiveServer,
    call,
    call_many,
    chat_body,
    load_is_zero,
    product_json,
    wait_until,
)
from vlm_catalog.engine.async_engine import AsyncLLM
from vlm_catalog.paths import DEFAULT_MODEL_DIR
from vlm_catalog.server import ServerSettings, create_app

LONG = chat_body(max_tokens=40, guided_regex="[ab]{40}")
ENDLESS = chat_body(max_tokens=5000, guided_regex="[ab]{5000}")


@pytest.fixture(scope="module")
def small_engine():
    """Two requests computed at a time (its last test shuts it down)."""
    engine = AsyncLLM(model=DEFAULT_MODEL_DIR, max_num_seqs=2)
    yield engine
    engine.shutdown()


def test_past_capacity_requests_get_429_with_retry_after(small_engine):
    app = create_app(small_engine, ServerSettings(max_waiting_requests=1, retry_after_s=3))
    answers = call_many(app, [("POST", "/v1/chat/completions", {"json": LONG})] * 10)
    statuses = [answer.status_code for answer in answers]
    assert set(statuses) == {200, 429} and statuses.count(200) >= 3
    for answer in answers:
        if answer.status_code == 429:
            assert answer.headers["retry-after"] == "3"
            assert answer.json()["error"]["code"] == "server_busy"
        else:
            assert len(answer.json()["choices"][0]["message"]["content"]) == 40
    assert wait_until(lambda: load_is_zero(small_engine), timeout=5)
    # once the burst is over, the service takes requests again
    assert call(app, "POST", "/v1/chat/completions", json=chat_body()).status_code == 200


def test_a_batch_larger_than_the_service_can_ever_hold_is_400_not_429(small_engine, records):
    """max_batch_products (64) above the capacity (2 running + 1 waiting): before, a 429 saying
    "0 requests in flight, at most 3; retry in 1 s", which no retry could pass."""
    app = create_app(small_engine, ServerSettings(max_waiting_requests=1))
    products = [product_json(records[index % len(records)]) for index in range(4)]
    response = call(app, "POST", "/v1/extract/batch", json={"products": products})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "batch_too_large" and error["param"] == "products"
    assert "holds at most 3 requests at once" in error["message"]
    answered = call(app, "POST", "/v1/extract/batch", json={"products": products[:3]})
    assert answered.status_code == 200 and len(answered.json()["results"]) == 3


def test_a_request_past_its_timeout_is_answered_408_and_aborted(small_engine):
    app = create_app(small_engine, ServerSettings(request_timeout_s=0.5))
    started = time.perf_counter()
    response = call(app, "POST", "/v1/chat/completions", json=ENDLESS)
    assert response.status_code == 408 and response.json()["error"]["code"] == "request_timeout"
    assert time.perf_counter() - started < 5
    assert wait_until(lambda: load_is_zero(small_engine), timeout=5)
    streamed = call(app, "POST", "/v1/chat/completions", json={**ENDLESS, "stream": True})
    assert streamed.status_code == 200  # the stream had begun: the timeout is its last event
    assert '"code": "request_timeout"' in streamed.text and streamed.text.rstrip().endswith("data: [DONE]")
    assert wait_until(lambda: load_is_zero(small_engine), timeout=5)


def test_api_key_guards_every_endpoint_but_health(engine, caplog):
    key = "sk-test-very-secret-9f8e7d"
    app = create_app(engine, ServerSettings(api_key=key))
    caplog.set_level(logging.DEBUG)
    assert call(app, "GET", "/health").status_code == 200
    for method, path, kwargs in [
        ("GET", "/v1/models", {}), ("GET", "/metrics", {}), ("GET", "/docs", {}),
        ("POST", "/v1/chat/completions", {"json": chat_body()}),
        ("POST", "/v1/chat/completions", {"content": b"not json"}),
        ("POST", "/v1/extract", {"json": {}}), ("POST", "/v1/extract/batch", {"json": {"products": []}}),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key},
                        {"Authorization": f"Basic {key}"}):
            response = call(app, method, path, headers=headers, **kwargs)
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
            assert key not in response.text
    authorised = {"Authorization": f"Bearer {key}"}
    assert call(app, "GET", "/v1/models", headers=authorised).json()["data"][0]["id"] == MODEL_NAME
    assert call(app, "POST", "/v1/chat/completions", json=chat_body(), headers=authorised).status_code == 200
    assert key not in caplog.text
    assert key not in repr(ServerSettings(api_key=key))


def _open_request(url: str, body: dict) -> socket.socket:
    """Send a POST on a raw connection and leave it open (closing it is the client going away)."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    connection = socket.create_connection((host, int(port)))
    connection.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload)
    return connection


def test_a_stream_whose_client_leaves_while_queued_is_dropped_from_the_queue(small_engine):
    with LiveServer(create_app(small_engine)) as live:
        fillers = [_open_request(live.url, ENDLESS) for _ in range(2)]  # both running places taken
        assert wait_until(lambda: small_engine.load_stats()["requests_running"] == 2)
        queued = _open_request(live.url, {**ENDLESS, "stream": True})
        assert wait_until(lambda: small_engine.load_stats()["requests_waiting"] == 1)
        queued.close()
        assert wait_until(lambda: small_engine.load_stats()["requests_waiting"] == 0, timeout=3)
        assert small_engine.load_stats()["requests_running"] == 2
        for filler in fillers:
            filler.close()
        assert wait_until(lambda: load_is_zero(small_engine), timeout=3)


def test_health_is_503_once_the_engine_has_stopped(small_engine):
    app = create_app(small_engine)

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://service", timeout=60) as client:
            in_flight = asyncio.ensure_future(client.post("/v1/chat/completions", json=ENDLESS))
            await asyncio.sleep(0.5)
            await asyncio.get_running_loop().run_in_executor(None, small_engine.shutdown)
            return await in_flight, await client.get("/health"), await client.post("/v1/chat/completions",
                                                                                    json=chat_body())

    in_flight, health, after = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert in_flight.status_code == 503 and in_flight.json()["error"]["code"] == "engine_unavailable"
    assert health.status_code == 503
    assert after.status_code == 503 and after.json()["error"]["code"] == "engine_unavailable"
