"""Bad input: every case is a 4xx with an OpenAI-style body naming the problem; the service keeps serving."""

from __future__ import annotations

import json
import struct
import zlib

import pytest

from tests.model.helpers import noise_image
from tests.server.conftest import MODEL_NAME, call, chat_body, data_uri, png_bytes, product_json
from vlm_catalog.server import ServerSettings, create_app

LIMITS = dict(max_text_field_bytes=2048, max_body_bytes=96 * 1024, max_images_per_request=2,
              max_image_pixels=300 * 300, max_batch_products=4)


@pytest.fixture(scope="module")
def strict_app(engine):
    return create_app(engine, ServerSettings(**LIMITS))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height, with no pixel data behind it (a bomb's shape)."""
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


def image_message(*urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]}]


GOOD_PNG = png_bytes()
TRUNCATED_PNG = png_bytes(120, 90, (10, 200, 30))[:-40]
_JPEG = noise_image(120, 90, seed=3, fmt="JPEG")
TRUNCATED_JPEG = _JPEG[: len(_JPEG) * 2 // 3]
SCHEMA_OK = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}


def nested_schema_body(depth: int) -> bytes:
    """A chat body whose json_schema nests `depth` objects, as raw JSON (json.dumps would recurse)."""
    schema = '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + '},"required":["a"]}' * depth
    body = json.dumps(chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": 0}}))
    return body.replace('"schema": 0', f'"schema": {schema}').encode()

# (name, body or raw bytes, expected status, expected code, expected param or None)
CHAT_CASES = [
    ("not json", b"{'model': 1", 400, "invalid_json", None),
    ("json array", b"[1, 2]", 400, "invalid_value", None),
    # FastAPI answers both with "There was an error parsing the body" alone
    ("not UTF-8", b'{"model": "\xff"}', 400, "invalid_json", None),
    ("nested too deeply", b"[" * 5000, 400, "invalid_json", None),
    ("missing messages", {"model": MODEL_NAME}, 400, "missing_field", "messages"),
    ("messages not a list", chat_body(messages="hello"), 400, "invalid_value", "messages"),
    ("empty messages", chat_body(messages=[]), 400, "invalid_value", "messages"),
    ("content wrong type", chat_body(messages=[{"role": "user", "content": 5}]), 400, "invalid_value", "messages.0.content"),
    ("unknown role", chat_body(messages=[{"role": "hacker", "content": "hi"}]), 400, "invalid_value", "messages.0.role"),
    ("unknown part type", chat_body(content=[{"type": "audio", "audio": "x"}]), 400, "invalid_value", "messages.0.content.0"),
    ("temperature as text", chat_body(temperature="hot"), 400, "invalid_value", "temperature"),
    ("temperature out of range", chat_body(temperature=3.5), 400, "invalid_value", "temperature"),
    ("top_p zero", chat_body(top_p=0), 400, "invalid_value", "top_p"),
    ("max_tokens zero", chat_body(max_tokens=0), 400, "invalid_value", "max_tokens"),
    ("max_tokens as text", chat_body(max_tokens="5"), 400, "invalid_value", "max_tokens"),
    ("seed below a signed 64-bit integer", chat_body(seed=-(2**63) - 1), 400, "invalid_value", "seed"),
    ("seed above a signed 64-bit integer", chat_body(seed=2**63), 400, "invalid_value", "seed"),
    ("n of two", chat_body(n=2), 400, "invalid_value", "n"),
    ("stream as text", chat_body(stream="yes"), 400, "invalid_value", "stream"),
    ("too many stops", chat_body(stop=["a", "b", "c", "d", "e"]), 400, "invalid_value", "stop"),
    ("empty stop", chat_body(stop=[""]), 400, "invalid_value", "stop"),  # before, param null
    ("stop beside json_object", chat_body(stop="x", response_format={"type": "json_object"}), 400, "invalid_value",
     "stop"),
    ("stream_options without stream", chat_body(stream_options={"include_usage": True}), 400, "invalid_value",
     "stream_options"),  # as OpenAI answers; before, accepted and ignored
    ("repetition penalty", chat_body(repetition_penalty=1.1), 400, "unsupported_field", "repetition_penalty"),
    ("top_k below -1", chat_body(top_k=-2), 400, "invalid_value", "top_k"),
    ("min_p over 1", chat_body(min_p=1.5), 400, "invalid_value", "min_p"),
    ("tools", chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "unsupported_field", "tools"),
    ("text too long", chat_body(content="x" * 2049), 400, "text_too_long", "messages.0.content"),
    ("part text too long", chat_body(content=[{"type": "text", "text": "é" * 1025}]), 400, "text_too_long",
     "messages.0.content.0.text"),
    ("body too large", chat_body(content=[{"type": "text", "text": "y" * 1000}] * 100), 413, "body_too_large", None),
    ("lone surrogate", chat_body(content="price \ud800 tag"), 400, "invalid_unicode", "messages.0.content"),
    ("lone surrogate in a stop string", chat_body(stop=["\udc00"]), 400, "invalid_unicode", "stop.0"),
    ("zero-byte image", chat_body(messages=image_message("data:image/png;base64,")), 400, "image_empty",
     "messages.0.content.0.image_url.url"),
    ("non-image bytes", chat_body(messages=image_message(data_uri(b"%PDF-1.4 not an image at all"))), 400,
     "image_unsupported_format", "messages.0.content.0.image_url.url"),
    ("random bytes", chat_body(messages=image_message(data_uri(b"\x01\x02garbage" * 20))), 400, "image_not_an_image",
     "messages.0.content.0.image_url.url"),
    ("bad base64", chat_body(messages=image_message("data:image/png;base64,@@@not-base64@@@")), 400, "image_bad_base64",
     "messages.0.content.0.image_url.url"),
    ("truncated png", chat_body(messages=image_message(data_uri(TRUNCATED_PNG))), 400, "image_truncated",
     "messages.0.content.0.image_url.url"),
    # a JPEG's header probes fine; its cut pixel data fails when the engine decodes it: still this request's 400
    ("truncated jpeg", chat_body(messages=image_message(data_uri(TRUNCATED_JPEG, "image/jpeg"))), 400,
     "request_failed", None),
    ("over the pixel limit", chat_body(messages=image_message(data_uri(png_bytes(400, 300))), max_tokens=2), 400,
     "image_too_large", "messages.0.content.0.image_url.url"),
    ("decompression bomb", chat_body(messages=image_message(data_uri(png_header_only(40000, 40000)))), 400, None,
     "messages.0.content.0.image_url.url"),
    ("too many images", chat_body(messages=image_message(*[data_uri(GOOD_PNG)] * 3)), 400, "too_many_images", "messages"),
    ("remote url without allow-list", chat_body(messages=image_message("http://169.254.169.254/latest/meta-data")), 400,
     "image_host_not_allowed", "messages.0.content.0.image_url.url"),
    ("local file path", chat_body(messages=image_message("/etc/passwd")), 400, "image_url_not_allowed",
     "messages.0.content.0.image_url.url"),
    ("file url", chat_body(messages=image_message("file:///etc/passwd")), 400, "image_url_not_allowed",
     "messages.0.content.0.image_url.url"),
    ("invalid json schema", chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}), 400, "invalid_response_format",
     "response_format.json_schema.schema"),
    # deeper than MAX_SCHEMA_DEPTH: before, 40 levels compiled, 100 were a 500 (RecursionError), 1000 reset the connection
    ("json schema nested 40 objects deep", nested_schema_body(40), 400, "invalid_response_format",
     "response_format.json_schema.schema"),
    ("json schema nested 300 objects deep", nested_schema_body(300), 400, "invalid_response_format",
     "response_format.json_schema.schema"),
    # Python's json reads NaN: before, the grammar compiler's "Check failed: ... syntax error near: NaN"
    ("json schema holding NaN", chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "number", "maximum": float("nan")}}}), 400, "invalid_response_format",
     "response_format.json_schema.schema"),
    # keywords the grammar drops: before, a 200 whose answer failed the schema ({"u": [3, 3, 3]})
    ("json schema the grammar cannot keep", chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True}}}), 400,
     "invalid_response_format", "response_format.json_schema.schema"),
    # no finite answer: before, the forced string exhausted the memory (a 500 failing every request in flight)
    ("json schema with no finite answer", chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}}}), 400,
     "invalid_response_format", "response_format.json_schema.schema"),
    ("json_schema without schema", chat_body(response_format={"type": "json_schema"}), 400, "missing_field",
     "response_format.json_schema"),
    ("unknown response format", chat_body(response_format={"type": "yaml"}), 400, "invalid_value",
     "response_format.type"),
    # the grammar compiler's refusals name the field (param null, code request_failed before)
    ("invalid regex", chat_body(guided_regex="(unclosed[a-"), 400, "invalid_response_format", "guided_regex"),
    ("json schema with no integer in range", chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}), 400, "invalid_response_format",
     "response_format.json_schema.schema"),
    ("regex and response_format", chat_body(guided_regex="a+", response_format={"type": "json_object"}), 400,
     "invalid_value", "guided_regex"),
    ("another model", chat_body(model="gpt-4o"), 404, "model_not_found", "model"),
]


def _post(app, path: str, body) -> object:
    """POST JSON (or raw bytes as JSON); ASCII escapes, so lone surrogates travel as `\\ud800`."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return call(app, "POST", path, content=content, headers={"content-type": "application/json"})


def assert_error(response, status: int, code: str | None, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("name,body,status,code,param", CHAT_CASES, ids=[case[0] for case in CHAT_CASES])
def test_bad_chat_request(strict_app, name, body, status, code, param):
    error = assert_error(_post(strict_app, "/v1/chat/completions", body), status, code, param)
    if name == "decompression bomb":
        assert error["code"] in ("image_too_large", "image_decompression_bomb")
    if name.startswith("truncated"):
        assert "truncated" in error["message"] or "corrupt" in error["message"]
    if name == "json schema holding NaN":
        assert error["message"] == "json_schema: holds NaN or Infinity, which JSON does not allow"
    if name == "lone surrogate":
        assert "unpaired surrogate" in error["message"]


def test_streaming_requests_are_refused_before_the_stream_starts(strict_app):
    for body, code, param in ((chat_body(messages=image_message(data_uri(TRUNCATED_JPEG, "image/jpeg"))), "request_failed",
                               None), (chat_body(guided_regex="(bad"), "invalid_response_format", "guided_regex")):
        response = _post(strict_app, "/v1/chat/completions", {**body, "stream": True})
        assert_error(response, 400, code, param)


def extract_cases(record) -> list:
    good = product_json(record)
    return [
        ("not json", b"not json", 400, "invalid_json", None),
        ("nested too deeply", b"[" * 5000, 400, "invalid_json", None),  # a 500 (RecursionError) before
        ("not an object", b"[]", 400, "invalid_value", None),
        ("missing candidates", {k: v for k, v in good.items() if k != "candidate_categories"}, 400, "missing_field",
         "candidate_categories"),
        ("empty candidates", {**good, "candidate_categories": []}, 400, "invalid_value", "candidate_categories"),
        ("blank candidate", {**good, "candidate_categories": ["A > B", "  "]}, 400, None, "candidate_categories"),
        ("candidates wrong type", {**good, "candidate_categories": "A > B"}, 400, "invalid_value",
         "candidate_categories"),
        ("unknown field", {**good, "colour": "red"}, 400, "invalid_value", "colour"),
        ("unknown schema", {**good, "schema": "no_such_schema"}, 400, "unknown_schema", "schema"),
        ("image not base64", {**good, "image": "***"}, 400, "image_bad_base64", "image"),
        ("image empty", {**good, "image": ""}, 400, None, "image"),
        ("image file path", {**good, "image": "file:///etc/hostname"}, 400, "image_url_not_allowed", "image"),
        ("title too long", {**good, "title": "t" * 3000}, 400, "text_too_long", "title"),
        ("max_tokens negative", {**good, "max_tokens": -3}, 400, "invalid_value", "max_tokens"),
        ("title surrogate", {**good, "title": "bad \udc80"}, 400, "invalid_unicode", "title"),
        ("candidate surrogate", {**good, "candidate_categories": ["A > \ud801"]}, 400, "invalid_unicode",
         "candidate_categories.0"),
    ]


def test_bad_extract_requests(strict_app, records):
    for name, body, status, code, param in extract_cases(records[5]):
        response = _post(strict_app, "/v1/extract", body)
        assert response.status_code == status, (name, response.text)
        assert_error(response, status, code, param)


def test_bad_multipart_extract_requests(strict_app, records):
    record = records[6]
    form = {"title": record.title, "description": record.description,
            "candidate_categories": '["A > B", "C > D"]'}
    no_image = call(strict_app, "POST", "/v1/extract", data=form, files={"other": ("x.txt", b"x", "text/plain")})
    assert_error(no_image, 400, None, "image")
    bad_number = call(strict_app, "POST", "/v1/extract", data={**form, "max_tokens": "many"},
                      files={"image": ("p.jpg", record.image, "image/jpeg")})
    assert_error(bad_number, 400, "invalid_value", "max_tokens")
    bad_list = call(strict_app, "POST", "/v1/extract", data={**form, "candidate_categories": "[not json"},
                    files={"image": ("p.jpg", record.image, "image/jpeg")})
    assert_error(bad_list, 400, "invalid_value", "candidate_categories")
    deep_list = call(strict_app, "POST", "/v1/extract", data={**form, "candidate_categories": "[" * 1500},
                     files={"image": ("p.jpg", record.image, "image/jpeg")})
    assert_error(deep_list, 400, "invalid_value", "candidate_categories")
    assert "nested too deeply" in deep_list.json()["error"]["message"]
    long_part = call(strict_app, "POST", "/v1/extract", data={**form, "title": "t" * 3000},
                     files={"image": ("p.jpg", record.image, "image/jpeg")})
    assert_error(long_part, 400, "invalid_multipart", None)  # was code http_error: Starlette's own exception
    assert long_part.json()["error"]["message"] == "cannot read the multipart form: Part exceeded maximum size of 2KB."
    not_an_image = call(strict_app, "POST", "/v1/extract", data=form, files={"image": ("p.jpg", b"", "image/jpeg")})
    assert_error(not_an_image, 400, None, "image")
    # one cp1252 byte (a non-breaking space) among UTF-8 text: before, the whole field was read as
    # Latin-1 ("CafÃ© > Bols\xa0") and answered 200, a category the client never sent
    stray_byte = '["Café > Tasses", "Café > Bols\xa0"]'.encode("utf-8").replace(b"\xc2\xa0", b"\xa0")
    mojibake = call(strict_app, "POST", "/v1/extract", data={k: v for k, v in form.items() if k != "candidate_categories"},
                    files={"candidate_categories": (None, stray_byte), "image": ("p.jpg", record.image, "image/jpeg")})
    assert_error(mojibake, 400, "invalid_multipart", None)
    at = stray_byte.index(b"\xa0")
    assert mojibake.json()["error"]["message"] == ("cannot read the multipart form: field 'candidate_categories' is not "
                                                  f"valid utf-8 text (byte {at}: invalid start byte)")


def test_bad_batches(strict_app, records):
    products = [product_json(record) for record in records[:5]]
    assert_error(_post(strict_app, "/v1/extract/batch", {"products": products}), 400, "batch_too_large", "products")
    assert_error(_post(strict_app, "/v1/extract/batch", {"products": []}), 400, "invalid_value", "products")
    assert_error(_post(strict_app, "/v1/extract/batch", {"items": products[:1]}), 400, None, None)
    deep = _post(strict_app, "/v1/extract/batch", b"[" * 5000)
    assert_error(deep, 400, "invalid_json", None)
    assert deep.json()["error"]["message"] == "the request body is not valid JSON: nested too deeply"


def test_the_service_keeps_serving_after_bad_requests(strict_app, records):
    for _, body, *_ in CHAT_CASES[:12]:
        _post(strict_app, "/v1/chat/completions", body)
    assert call(strict_app, "GET", "/health").status_code == 200
    assert call(strict_app, "POST", "/v1/chat/completions", json=chat_body()).status_code == 200
    good = call(strict_app, "POST", "/v1/extract", json=product_json(records[7]))
    assert good.status_code == 200 and good.json()["metadata"] is not None
    errors = [line for line in call(strict_app, "GET", "/metrics").text.splitlines()
              if line.startswith("vlm_catalog_request_errors_total{")]
    assert errors and all(float(line.split()[-1]) >= 1 for line in errors)
