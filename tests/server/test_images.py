"""Image URLs: fetched only from allowed hosts, never from internal addresses, with size limits; bodies capped."""

from __future__ import annotations

import http.server
import threading

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, LiveServer, call, chat_body, error_counts, png_bytes
from vlm_catalog.server import ServerSettings, create_app

PNG = png_bytes(48, 36)
BIG = png_bytes(64, 64) + b"\x00" * 5000


class _Files(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        if self.path == "/redirect.png":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/")
            self.end_headers()
            return
        payload = {"/product.png": PNG, "/big.png": BIG}.get(self.path)
        if payload is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def file_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def image_chat(url: str) -> dict:
    return chat_body(content=[{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}])


def post(base: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)


def test_allowed_host_is_fetched_with_limits(engine, file_server):
    settings = ServerSettings(allowed_image_hosts=["127.0.0.1"], allow_private_image_addresses=True,
                              image_fetch_max_bytes=2000)
    with LiveServer(create_app(engine, settings)) as live:
        fetched = post(live.url, image_chat(f"{file_server}/product.png"))
        assert fetched.status_code == 200, fetched.text
        assert fetched.json()["usage"]["prompt_tokens"] > 10  # the image's tokens are in the prompt
        for path, code in (("/big.png", "image_too_large"), ("/missing.png", "image_fetch_failed"),
                           ("/redirect.png", "image_fetch_failed")):
            response = post(live.url, image_chat(f"{file_server}{path}"))
            assert response.status_code == 400 and response.json()["error"]["code"] == code, response.text
        other_host = post(live.url, image_chat("http://example.com/a.png"))
        assert other_host.json()["error"]["code"] == "image_host_not_allowed"


def test_allowed_host_resolving_to_an_internal_address_is_refused(engine, file_server):
    settings = ServerSettings(allowed_image_hosts=["127.0.0.1", "localhost"])
    with LiveServer(create_app(engine, settings)) as live:
        for url in (f"{file_server}/product.png", file_server.replace("127.0.0.1", "localhost") + "/product.png"):
            response = post(live.url, image_chat(url))
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "image_host_not_allowed" and "non-public address" in error["message"]


def test_a_chunked_body_over_the_limit_is_413(engine):
    app = create_app(engine, ServerSettings(max_body_bytes=4096))

    async def chunks():
        yield b'{"model": "' + MODEL_NAME.encode() + b'", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}]}'

    response = call(app, "POST", "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
    assert error_counts(app) == {"body_too_large": 1.0}  # once: FastAPI's 400 for the failed read was counted too
    declared = call(app, "POST", "/v1/extract", content=b"x" * 5000, headers={"content-type": "application/json"})
    assert declared.status_code == 413
    assert call(app, "POST", "/v1/chat/completions", json=chat_body()).status_code == 200
