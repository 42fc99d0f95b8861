"""The endpoints in-process (httpx's ASGI transport): answers, shapes, extraction, streaming, metrics."""

from __future__ import annotations

import json

from schemas import ProductMetadata
from tests.server.conftest import MODEL_NAME, call, call_many, chat_body, product_json


def sse_events(text: str) -> list:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def test_models_health_and_unknown_model(app):
    assert call(app, "GET", "/health").json() == {"status": "ok"}
    models = call(app, "GET", "/v1/models").json()
    assert [model["id"] for model in models["data"]] == [MODEL_NAME]
    assert call(app, "GET", f"/v1/models/{MODEL_NAME}").json()["id"] == MODEL_NAME
    for response in (call(app, "GET", "/v1/models/gpt-4o"),
                     call(app, "POST", "/v1/chat/completions", json=chat_body(model="gpt-4o"))):
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "model_not_found" and "gpt-4o" in response.json()["error"]["message"]


def test_extract_json_gives_validated_metadata_among_the_candidates(app, records):
    record = records[0]
    response = call(app, "POST", "/v1/extract", json=product_json(record))
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) >= {"id", "metadata", "raw", "finish_reason", "usage", "timings"}
    assert body["id"].startswith("extract-") and body["record_id"] == record.id
    metadata = ProductMetadata.model_validate(body["metadata"])
    assert metadata == ProductMetadata.model_validate_json(body["raw"])
    assert metadata.category in record.candidate_categories
    assert body["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] > 100 and body["usage"]["completion_tokens"] >= 1
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert 0 < body["timings"]["time_to_first_token_seconds"] <= body["timings"]["total_seconds"]


def test_extract_with_a_tiny_token_budget_still_gives_valid_metadata(app, records):
    record = records[1]
    response = call(app, "POST", "/v1/extract", json={**product_json(record), "max_tokens": 12})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["finish_reason"] == "stop" and "error" not in body
    assert ProductMetadata.model_validate(body["metadata"]).category in record.candidate_categories


def test_extract_answers_like_the_offline_llm(app, engine, records):
    """Same prompt, same per-record schema, greedy: the service's raw answers equal LLM.extract's."""
    from vlm_catalog import LLM

    chosen = records[:3]
    offline = LLM()
    try:
        expected = [result.text for result in offline.extract(chosen)]
    finally:
        offline.engine.close()
    answers = call_many(app, [("POST", "/v1/extract", {"json": product_json(r)}) for r in chosen])
    assert [answer.json()["raw"] for answer in answers] == expected


def test_extract_multipart_with_an_uploaded_file_equals_json(app, records):
    record = records[1]
    as_json = call(app, "POST", "/v1/extract", json=product_json(record)).json()
    form = {
        "title": record.title, "description": record.description,
        "candidate_categories": json.dumps(list(record.candidate_categories)), "max_tokens": "150",
    }
    response = call(app, "POST", "/v1/extract", data=form, files={"image": ("product.jpg", record.image, "image/jpeg")})
    assert response.status_code == 200, response.text
    assert response.json()["raw"] == as_json["raw"]
    # candidates as repeated form fields work too
    repeated = {**form, "candidate_categories": list(record.candidate_categories)}
    response = call(app, "POST", "/v1/extract", data=repeated, files={"image": ("p.jpg", record.image, "image/jpeg")})
    assert response.json()["raw"] == as_json["raw"]


def test_extract_batch_answers_in_order_and_each_product_fails_alone(app, records):
    good = [product_json(records[i]) for i in (2, 3)]
    broken_image = {**good[0], "image": "aGVsbG8gd29ybGQ="}  # base64 of "hello world"
    missing_title = {k: v for k, v in good[1].items() if k != "title"}
    response = call(app, "POST", "/v1/extract/batch",
                    json={"products": [good[0], broken_image, missing_title, "not an object", good[1]]})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert len(results) == 5
    singles = call_many(app, [("POST", "/v1/extract", {"json": product}) for product in good])
    assert [results[0]["raw"], results[4]["raw"]] == [single.json()["raw"] for single in singles]
    assert results[1]["status"] == 400 and results[1]["error"]["param"] == "products.1.image"
    assert results[1]["error"]["code"] == "image_not_an_image"
    assert results[2]["status"] == 400 and results[2]["error"]["param"] == "products.2.title"
    assert results[3]["status"] == 400 and results[3]["error"]["param"] == "products.3"


THING_SCHEMA = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green"]},
                                                "ok": {"type": "boolean"}},
                "required": ["colour", "ok"], "additionalProperties": False}


def test_chat_plain_json_schema_and_json_object(app):
    response = call(app, "POST", "/v1/chat/completions", json=chat_body(
        max_tokens=60, response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": THING_SCHEMA}}))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL_NAME
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "stop"
    answer = json.loads(choice["message"]["content"])
    assert set(answer) == {"colour", "ok"} and answer["colour"] in ("red", "green") and isinstance(answer["ok"], bool)
    # json_object: whatever the (tiny, untrained for chat) model writes is an object's beginning
    as_object = call(app, "POST", "/v1/chat/completions", json=chat_body(
        max_tokens=12, response_format={"type": "json_object"})).json()
    assert as_object["choices"][0]["message"]["content"].startswith("{")


def test_chat_stop_seed_and_developer_role(app):
    body = chat_body(max_tokens=30)
    whole = call(app, "POST", "/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert len(whole) >= 6, whole
    stop = whole[len(whole) // 2:][:3]  # three characters from the middle of the greedy answer
    answer = call(app, "POST", "/v1/chat/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert answer["message"]["content"] == whole[: whole.index(stop)] and answer["finish_reason"] == "stop"
    # with a constraint, a stop string would cut the answer before it matches
    refused = call(app, "POST", "/v1/chat/completions", json={**body, "guided_regex": "(ab){10}", "stop": ["b"]})
    assert refused.status_code == 400 and "stop strings cannot be combined" in refused.json()["error"]["message"]
    sampled = chat_body(max_tokens=12, temperature=1.0, top_p=0.9, seed=7,
                        messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    first, second = call_many(app, [("POST", "/v1/chat/completions", {"json": sampled})] * 2)
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["message"] == second.json()["choices"][0]["message"]
    # any signed 64-bit seed, as OpenAI and vLLM take it: clients send -1 (before, a 400)
    for seed in (-1, -(2**63)):
        negative = [call(app, "POST", "/v1/chat/completions", json={**sampled, "seed": seed}) for _ in range(2)]
        assert negative[0].status_code == 200, negative[0].text
        assert negative[0].json()["choices"][0]["message"] == negative[1].json()["choices"][0]["message"]


def test_streaming_adds_up_to_the_plain_answer_and_reports_usage(app):
    body = chat_body(max_tokens=12)
    call(app, "POST", "/v1/chat/completions", json=body)  # the prompt in the prefix cache, whatever ran before
    plain = call(app, "POST", "/v1/chat/completions", json=body).json()  # so both report the same cached tokens
    response = call(app, "POST", "/v1/chat/completions",
                    json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(event["choices"][0]["delta"].get("content", "") for event in events if event["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    finishing = [event for event in events if event["choices"] and event["choices"][0]["finish_reason"]]
    assert [event["choices"][0]["finish_reason"] for event in finishing] == [plain["choices"][0]["finish_reason"]]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == plain["usage"]
    # OpenAI: "All other chunks will also include a usage field, but with a null value" (before, no key)
    assert all("usage" in event and event["usage"] is None for event in events[:-1])
    without_usage = sse_events(call(app, "POST", "/v1/chat/completions", json={**body, "stream": True}).text)
    assert all("usage" not in event for event in without_usage)
    as_null = call(app, "POST", "/v1/chat/completions", json={**body, "stream": None})  # OpenAI's default: not streamed
    assert as_null.status_code == 200 and as_null.json()["choices"] == plain["choices"]


def test_metrics_expose_the_documented_names(app, records):
    call(app, "POST", "/v1/extract", json=product_json(records[4]))
    call(app, "POST", "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    text = call(app, "GET", "/metrics").text
    for name in (
        "vlm_catalog_time_to_first_token_seconds_bucket", "vlm_catalog_e2e_request_latency_seconds_count",
        "vlm_catalog_requests_running", "vlm_catalog_requests_waiting", "vlm_catalog_kv_cache_usage_ratio",
        "vlm_catalog_prefix_cache_hit_ratio", "vlm_catalog_prompt_tokens_total",
        "vlm_catalog_generation_tokens_total", 'vlm_catalog_request_errors_total{kind="invalid_json"}',
    ):
        assert name in text, name
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}
    assert values["vlm_catalog_prompt_tokens_total"] > 100
    assert 0.0 < values["vlm_catalog_prefix_cache_hit_ratio"] <= 1.0  # the shared system prompt is reused
    assert values["vlm_catalog_requests_running"] == 0.0 and values["vlm_catalog_kv_cache_usage_ratio"] == 0.0
