"""/metrics and the logs against what happened: each request counted once, latencies from arrival,
the service's places, and a line for every request whose client left before its answer."""

from __future__ import annotations

import asyncio
import json
import logging

from tests.server.conftest import (
    MODEL_NAME,
    asgi_scope,
    body_then_stay,
    call,
    chat_body,
    product_json,
)
from vlm_catalog.server import ServerSettings, create_app


def samples(app) -> dict[str, float]:
    """Every sample of the app's metrics, by name with its labels."""
    values = {}
    for line in app.state.service.metrics.exposition().decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def counted(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The request counters that changed."""
    return {name: after[name] - before.get(name, 0.0) for name in after
            if ("requests_finished_total" in name or "request_errors_total" in name)
            and after[name] != before.get(name, 0.0)}


def test_a_stream_whose_client_stalls_on_its_last_chunk_is_counted_once(engine):
    """The stream was counted as finished, then its client stopped reading the finishing chunk and
    it was counted again, as a timeout (or as a disconnect where the client left then)."""
    app = create_app(engine, ServerSettings(request_timeout_s=0.5))
    body = json.dumps(chat_body(stream=True, max_tokens=8, temperature=0)).encode()

    async def run():
        async def send(message):
            if message["type"] == "http.response.body" and b'"finish_reason": "length"' in message.get("body", b""):
                await asyncio.Event().wait()  # its window is full: this write never completes

        await asyncio.wait_for(app(asgi_scope("/v1/chat/completions", body), body_then_stay(body), send), 30)

    before = samples(app)
    asyncio.run(run())
    assert counted(before, samples(app)) == {'vlm_catalog_requests_finished_total{finish_reason="length"}': 1.0}


def test_latencies_count_from_arrival(engine, records, monkeypatch):
    """They counted from the engine call, leaving out the body, parsing and image decoding: an
    extraction whose preparation took 0.3 s reported less than its client waited."""
    from vlm_catalog.server import extract

    app = create_app(engine, ServerSettings())
    real_prepare = extract._prepare

    async def slow_prepare(*args, **kwargs):
        await asyncio.sleep(0.3)
        return await real_prepare(*args, **kwargs)

    monkeypatch.setattr(extract, "_prepare", slow_prepare)
    before = samples(app)
    response = call(app, "POST", "/v1/extract", json=product_json(records[0]))
    assert response.status_code == 200, response.text
    assert response.json()["timings"]["total_seconds"] >= 0.3
    assert response.json()["timings"]["time_to_first_token_seconds"] >= 0.3
    after = samples(app)
    assert after["vlm_catalog_e2e_request_latency_seconds_sum"] - before["vlm_catalog_e2e_request_latency_seconds_sum"] >= 0.3
    assert after["vlm_catalog_e2e_request_latency_seconds_count"] - before["vlm_catalog_e2e_request_latency_seconds_count"] == 1


def test_the_service_places_are_gauges(engine):
    settings = ServerSettings(max_waiting_requests=7)
    app = create_app(engine, settings)
    values = samples(app)
    assert values["vlm_catalog_service_capacity"] == engine.engine.config.max_num_seqs + 7
    assert values["vlm_catalog_requests_in_service"] == 0
    with app.state.service.gateway.admit(3):
        assert samples(app)["vlm_catalog_requests_in_service"] == 3
    assert samples(app)["vlm_catalog_requests_in_service"] == 0


def test_a_client_gone_before_its_answer_is_a_log_line(engine, caplog):
    """The 499 given for the access log never reached it (the server drops a response sent after the
    client left): such requests were in the metrics only."""
    app = create_app(engine, ServerSettings())
    body = json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}],
                       "max_tokens": 64}).encode()

    async def run():
        messages = iter([{"type": "http.request", "body": body, "more_body": False}])

        async def receive():
            message = next(messages, None)
            if message is not None:
                return message
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}

        async def send(message):
            pass

        await asyncio.wait_for(app(asgi_scope("/v1/chat/completions", body), receive, send), 30)

    before = samples(app)
    with caplog.at_level(logging.INFO, logger="vlm_catalog.server.errors"):
        asyncio.run(run())
    assert counted(before, samples(app)) == {'vlm_catalog_request_errors_total{kind="client_disconnected"}': 1.0}
    assert '"POST /v1/chat/completions" 499: the client disconnected before its answer' in caplog.text
