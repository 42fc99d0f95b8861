"""Load: hundreds of concurrent requests on a real uvicorn, a fifth of them hostile.

Every good request gets a schema-valid answer, every hostile one a 4xx, /health
answers 200 throughout, and afterwards no request is running and no KV block is held.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json

import httpx
import pytest

from schemas import ProductMetadata
from tests.server.conftest import (
    MODEL_NAME,
    LiveServer,
    data_uri,
    load_is_zero,
    png_bytes,
    product_json,
    wait_until,
)
from vlm_catalog.server import ServerSettings, create_app

THING = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                                          "ok": {"type": "boolean"}},
         "required": ["colour", "ok"], "additionalProperties": False}


def good_requests(records, count: int) -> list[tuple[str, dict, str]]:
    """(path, body, kind) of well-formed requests: extractions, json_schema chats (plain and streaming)."""
    made = []
    for index in range(count):
        record = records[index % len(records)]
        if index % 2 == 0:
            made.append(("/v1/extract", product_json(record), "extract"))
        else:
            body = {"model": MODEL_NAME, "max_tokens": 40, "seed": index,
                    "messages": [{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": data_uri(record.image, "image/jpeg")}},
                        {"type": "text", "text": f"Item {index}: {record.title}"}]}],
                    "response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": THING}}}
            made.append(("/v1/chat/completions", {**body, "stream": index % 4 == 1}, "chat"))
    return made


def hostile_requests(records, count: int) -> list[tuple[str, dict | bytes, str]]:
    record = records[0]
    good = product_json(record)
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    kinds = [
        ("/v1/chat/completions", b"{{{{ not json", "bad"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "hacker", "content": "hi"}]}, "bad"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "x\ud800y"}]}, "bad"),
        ("/v1/chat/completions", {**chat, "temperature": -1}, "bad"),
        ("/v1/chat/completions", {**chat, "model": "other"}, "bad"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "z" * 70_000}]}, "bad"),
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": 5}}}}}}, "bad"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1:22/secret.png"}}]}]}, "bad"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(png_bytes()[:30])}}]}]}, "bad"),
        ("/v1/extract", {**good, "image": base64.b64encode(b"GIF89a" + b"\x00" * 5).decode()}, "bad"),
        ("/v1/extract", {**good, "candidate_categories": []}, "bad"),
        ("/v1/extract", {**good, "image": "data:image/png;base64,"}, "bad"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(png_bytes())}}] * 9}]}, "bad"),
    ]
    return list(itertools.islice(itertools.cycle(kinds), count))


async def _send(client: httpx.AsyncClient, path: str, body) -> tuple[int, object]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    is_stream = isinstance(body, dict) and body.get("stream")
    if not is_stream:
        response = await client.post(path, content=content, headers=headers)
        return response.status_code, response.json()
    async with client.stream("POST", path, content=content, headers=headers) as response:
        text = (await response.aread()).decode()
        if response.status_code != 200:
            return response.status_code, json.loads(text)
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
        pieces = [json.loads(event) for event in events]
        assert all("error" not in piece for piece in pieces), pieces
        return 200, "".join(piece["choices"][0]["delta"].get("content", "") for piece in pieces if piece["choices"])


def run_load(url: str, requests: list, health_checks: list[int]):
    async def poll_health(stop: asyncio.Event):
        # a fresh connection per check: a kept-alive one that sat idle past the server's keep-alive
        # timeout can be closed by the server just as a check is sent on it ("Server disconnected
        # without sending a response"), a race of the client's pool, not the server's health
        no_keepalive = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=no_keepalive) as client:
            while not stop.is_set():
                health_checks.append((await client.get("/health")).status_code)
                await asyncio.sleep(0.2)

    async def main():
        limits = httpx.Limits(max_connections=len(requests) + 10, max_keepalive_connections=len(requests) + 10)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
            stop = asyncio.Event()
            poller = asyncio.ensure_future(poll_health(stop))
            results = await asyncio.gather(*(_send(client, path, body) for path, body, _ in requests))
            stop.set()
            await poller
            return results

    return asyncio.run(main())


def check_load(engine, records, good_count: int, hostile_count: int) -> None:
    good = good_requests(records, good_count)
    hostile = hostile_requests(records, hostile_count)
    requests = [item for pair in itertools.zip_longest(good, hostile) for item in pair if item is not None]
    with LiveServer(create_app(engine, ServerSettings())) as server:
        health: list[int] = []
        results = run_load(server.url, requests, health)
        assert wait_until(lambda: load_is_zero(engine), timeout=10)
        after = httpx.get(f"{server.url}/health").status_code
    by_path_record = {id(body): index for index, (_, body, _) in enumerate(good)}
    for (path, body, kind), (status, answer) in zip(requests, results):
        if kind == "bad":
            assert 400 <= status < 500, (path, status, answer)
            assert set(answer["error"]) == {"message", "type", "param", "code"}
            continue
        assert status == 200, (path, answer)
        if path == "/v1/extract":
            record = records[by_path_record[id(body)] % len(records)]
            metadata = ProductMetadata.model_validate(answer["metadata"])
            assert metadata.category in record.candidate_categories
        else:
            text = answer if isinstance(answer, str) else answer["choices"][0]["message"]["content"]
            value = json.loads(text)
            assert set(value) == {"colour", "ok"} and value["colour"] in THING["properties"]["colour"]["enum"]
    assert health and set(health) == {200} and after == 200


def test_load_mixed_with_hostile_requests(engine, records):
    check_load(engine, records, good_count=160, hostile_count=40)


@pytest.mark.slow
def test_load_large(engine, records):
    check_load(engine, records, good_count=480, hostile_count=120)
