"""A real uvicorn on 127.0.0.1 driven by the official `openai` client; disconnects free the engine at once."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest

from schemas import ProductMetadata
from tests.server.conftest import MODEL_NAME, LiveServer, load_is_zero, wait_until
from vlm_catalog.preprocess.prompt import build_messages
from vlm_catalog.server import ServerSettings, create_app
from vlm_catalog.structured import catalogue_schema

KEY = "live-test-key"


@pytest.fixture(scope="module")
def live(engine):
    with LiveServer(create_app(engine, ServerSettings(api_key=KEY))) as server:
        yield server


@pytest.fixture()
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_openai_client_plain_and_models(client):
    assert [model.id for model in client.models.list().data] == [MODEL_NAME]
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6,
    )
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage.completion_tokens == 6 or completion.choices[0].finish_reason == "stop"
    assert completion.usage.prompt_tokens > 0 and completion.model == MODEL_NAME


def test_openai_client_streaming_with_usage(client):
    request = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Count."}], max_tokens=10, seed=1)
    plain = client.chat.completions.create(**request)
    stream = client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == plain.usage.total_tokens


def test_openai_client_json_schema_extraction(client, records):
    record = records[8]
    messages = build_messages(record)
    schema = catalogue_schema(record.candidate_categories).json_schema
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=150, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "product", "schema": schema, "strict": True}},
    )
    answer = ProductMetadata.model_validate_json(completion.choices[0].message.content)
    assert answer.category in record.candidate_categories


def test_openai_errors_and_auth(live):
    wrong = openai.OpenAI(base_url=f"{live.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    right = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        right.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as caught:
        right.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], n=3)
    assert caught.value.body["param"] == "n"
    assert httpx.get(f"{live.url}/health").status_code == 200


def test_mlperf_style_async_client_many_in_flight(live, records):
    """Like the MLPerf reference harness: AsyncOpenAI, one request per sample, all in flight at once."""
    chosen = records[:24]

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0, timeout=120)

        async def one(record):
            schema = catalogue_schema(record.candidate_categories).json_schema
            completion = await client.chat.completions.create(
                model=MODEL_NAME, messages=build_messages(record), max_tokens=150, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "product", "schema": schema}},
            )
            return completion.choices[0].message.content

        try:
            return await asyncio.gather(*(one(record) for record in chosen))
        finally:
            await client.close()

    answers = asyncio.run(run())
    for record, answer in zip(chosen, answers):
        assert ProductMetadata.model_validate_json(answer).category in record.candidate_categories


ENDLESS = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "go"}], "max_tokens": 20000,
           "guided_regex": "[ab]{20000}"}


def disconnects_counted(metrics: str) -> float:
    name = 'vlm_catalog_request_errors_total{kind="client_disconnected"}'
    return sum(float(line.split()[1]) for line in metrics.splitlines() if line.startswith(name))


def test_a_disconnected_stream_is_aborted_and_frees_its_blocks(live, engine):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=live.url, headers=headers, timeout=30) as http:
        disconnects_before = disconnects_counted(http.get("/metrics").text)
        with http.stream("POST", "/v1/chat/completions", json={**ENDLESS, "stream": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            received = [next(lines) for _ in range(6)]
            assert any('"content"' in line for line in received)
            assert engine.load_stats()["requests_running"] == 1
            assert engine.load_stats()["kv_cache_usage_ratio"] > 0
        # leaving the block closes the connection mid-stream
        closed = time.perf_counter()
        assert wait_until(lambda: load_is_zero(engine), timeout=5)
        assert time.perf_counter() - closed < 3
        metrics = http.get("/metrics").text
    assert "vlm_catalog_requests_running 0.0" in metrics and "vlm_catalog_kv_cache_usage_ratio 0.0" in metrics
    assert disconnects_counted(metrics) == disconnects_before + 1  # before, only plain requests' were counted


def test_a_disconnected_plain_request_is_aborted_and_frees_its_blocks(live, engine):
    host, port = live.url.removeprefix("http://").split(":")
    body = json.dumps(ENDLESS).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(request)
        assert wait_until(lambda: engine.load_stats()["requests_running"] == 1, timeout=10)
        time.sleep(0.3)
        assert engine.load_stats()["kv_cache_usage_ratio"] > 0
    closed = time.perf_counter()
    assert wait_until(lambda: load_is_zero(engine), timeout=5)
    assert time.perf_counter() - closed < 3
    assert engine.engine.requests == {}
