"""`vlm-catalog serve` as a user runs it: prints its URL, serves, stops on SIGTERM/SIGINT with exit 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL_NAME

KEY = "cmd-secret-key-4242"
ENDLESS = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "go"}], "max_tokens": 20000,
           "guided_regex": "[ab]{20000}", "stream": True}


class Service:
    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "vlm_catalog.cli", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
            # SIGHUP as in a terminal, whatever this process inherited (under nohup the server keeps it ignored)
            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
        )
        self.lines: list[str] = []
        self.url: str | None = None
        ready = threading.Event()

        def read() -> None:
            for line in self.process.stdout:
                self.lines.append(line)
                found = re.search(r"serving '.*' at (http://\S+)", line)
                if found:
                    self.url = found.group(1)
                    ready.set()
            ready.set()

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        ready.wait(120)
        assert self.url, "".join(self.lines)

    def stop(self, sig: int, timeout: float = 15) -> tuple[int, float]:
        started = time.perf_counter()
        self.process.send_signal(sig)
        code = self.process.wait(timeout)
        self.reader.join(5)
        return code, time.perf_counter() - started

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def exit_after(self, started: float, timeout: float = 15) -> tuple[int, float]:
        """The exit status, and the seconds from `started` (the first signal) to the exit."""
        code = self.process.wait(timeout)
        return code, time.perf_counter() - started

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc_info) -> None:
        if self.process.poll() is None:  # a failed test leaves no server behind
            self.process.kill()
            self.process.wait()


def test_serve_answers_then_sigterm_with_requests_in_flight_answers_them_and_exits_0_quickly():
    """Past graceful_shutdown_s the requests still running are answered: a 503 naming the shutdown,
    a stream's error event and [DONE]. Before, uvicorn cancelled them: a plain-text 500 ("Internal
    Server Error") and a stream cut short, with tracebacks in the log."""
    with Service(env={"VLM_CATALOG_API_KEY": KEY, "VLM_CATALOG_GRACEFUL_SHUTDOWN_S": "1"}) as service:
        assert "(API key required)" in service.output
        headers = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(f"{service.url}/health").status_code == 200
        assert httpx.get(f"{service.url}/v1/models").status_code == 401
        assert httpx.get(f"{service.url}/v1/models", headers=headers).json()["data"][0]["id"] == MODEL_NAME
        plain: list[httpx.Response] = []
        with httpx.Client(base_url=service.url, headers=headers, timeout=30) as client:
            waiting = threading.Thread(target=lambda: plain.append(
                client.post("/v1/chat/completions", json={**ENDLESS, "stream": False})))
            waiting.start()
            with client.stream("POST", "/v1/chat/completions", json=ENDLESS) as response:
                lines = response.iter_lines()
                assert any('"content"' in next(lines) for _ in range(4))
                started = time.perf_counter()
                service.process.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line]
            waiting.join(30)
        code, seconds = service.exit_after(started)
    assert code == 0, service.output
    assert seconds < 10
    assert rest[-1] == "data: [DONE]" and '"code": "engine_unavailable"' in rest[-2] and "shutting down" in rest[-2]
    assert plain[0].status_code == 503 and plain[0].json()["error"]["code"] == "engine_unavailable"
    assert "the request was still running 1 s after the signal" in plain[0].json()["error"]["message"]
    assert "Traceback" not in service.output and KEY not in service.output


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT])
def test_serve_idle_stops_on_sigint_with_exit_0(sig):
    service = Service("--served-model-name", "catalogue-model", "--max-num-seqs", "8")
    try:
        assert "serving 'catalogue-model'" in service.output
        assert httpx.get(f"{service.url}/v1/models").json()["data"][0]["id"] == "catalogue-model"
        code, seconds = service.stop(sig)
    finally:
        if service.process.poll() is None:
            service.process.kill()
    assert code == 0, service.output
    assert seconds < 10


def test_serve_refuses_a_missing_model_with_exit_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "vlm_catalog.cli", "serve", "--model", str(tmp_path / "none")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "error:" in result.stderr


def test_serve_refuses_a_bad_memory_setting_with_exit_2():
    result = subprocess.run([sys.executable, "-m", "vlm_catalog.cli", "serve", "--gpu-memory-utilization", "1.5"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: gpu_memory_utilization must be in (0, 1], got 1.5"


def test_a_second_sigint_answers_the_running_requests_and_sighup_drains_too():
    """A second Ctrl-C made uvicorn cut the requests off (a plain-text 500, a CancelledError traceback): the
    engine now answers them with the 503 at once. SIGHUP (the terminal closed) killed the process without
    a drain; it stops the server as SIGTERM does. --max-images-per-request above the engine's 8 was
    accepted and then refused every request of 9 images: it now sets the engine's limit too."""
    from tests.server.conftest import data_uri, png_bytes

    image = {"type": "image_url", "image_url": {"url": data_uri(png_bytes())}}
    nine = {"model": MODEL_NAME, "max_tokens": 2,
            "messages": [{"role": "user", "content": [image] * 9 + [{"type": "text", "text": "which?"}]}]}
    for stops, grace in (((signal.SIGINT, signal.SIGINT), "60"), ((signal.SIGHUP,), "1")):
        with Service("--max-images-per-request", "9", env={"VLM_CATALOG_GRACEFUL_SHUTDOWN_S": grace}) as service:
            plain: list[httpx.Response] = []
            with httpx.Client(base_url=service.url, timeout=60) as client:
                assert client.post("/v1/chat/completions", json=nine).status_code == 200
                running = threading.Thread(target=lambda answers=plain, http=client: answers.append(
                    http.post("/v1/chat/completions", json={**ENDLESS, "stream": False})))
                running.start()
                time.sleep(1.0)
                started = time.perf_counter()
                for sig in stops:
                    service.process.send_signal(sig)
                    # the next signal only once this one was handled: two of a kind pending at once are one
                    deadline = time.monotonic() + 15
                    while "Shutting down" not in service.output and time.monotonic() < deadline:
                        time.sleep(0.05)
                running.join(30)
            code, seconds = service.exit_after(started)
        assert code == 0, service.output
        assert seconds < 10, seconds  # the second SIGINT did not wait for the 60 s grace
        assert plain[0].status_code == 503 and plain[0].json()["error"]["code"] == "engine_unavailable", plain[0].text
        assert "Traceback" not in service.output and "CancelledError" not in service.output


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        # `--api-key "$KEY"` with KEY unset turned the environment's key off: an open server
        (["--api-key", ""], {"VLM_CATALOG_API_KEY": "from-the-environment"}, "--api-key is empty"),
        (["--host", ""], {}, "host: Value error, host must not be empty"),  # listened on every interface
        (["--served-model-name", " "], {}, "served_model_name must not be empty"),
        ([], {"VLM_CATALOG_API_KEY": "abc123 "}, "begins or ends with white space"),  # every request a 401
        (["--api-key", "clé-secrète"], {}, "must be printable ASCII"),
        ([], {"VLM_CATALOG_ALLOWED_IMAGE_HOSTS": "cdn.example.com"}, "allowed_image_hosts"),  # was a traceback
        (["--device", "cuda:x"], {}, "device must be 'cpu' or 'cuda[:N]', got 'cuda:x'"),  # was a traceback
    ],
)
def test_serve_refuses_settings_that_would_misbehave_in_one_line(args, env, message, monkeypatch, capsys):
    from vlm_catalog.cli import main
    from vlm_catalog.server.command import AnnouncingServer

    def started(self):
        raise AssertionError("the server started")  # instead of serving for ever inside the test

    monkeypatch.setattr(AnnouncingServer, "run", started)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "--port", "0", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert "from-the-environment" not in err and "abc123" not in err


def test_a_model_given_as_dot_is_served_under_its_folders_name(monkeypatch):
    from vlm_catalog.engine.async_engine import AsyncLLM
    from vlm_catalog.paths import DEFAULT_MODEL_DIR
    from vlm_catalog.server import ServerSettings, create_app

    monkeypatch.chdir(DEFAULT_MODEL_DIR)
    engine = AsyncLLM(model=".")
    try:  # before: served as '', and a request naming the model got a 404
        assert create_app(engine, ServerSettings()).state.service.model_name == DEFAULT_MODEL_DIR.name
    finally:
        engine.shutdown()


def test_sighup_drains_unless_ignored_and_only_a_second_sigint_answers_at_once():
    """Under nohup (SIGHUP ignored) the server must outlive the terminal; a second SIGTERM (unlike a second
    Ctrl-C) leaves the grace period running."""
    import asyncio

    from vlm_catalog.server.command import AnnouncingServer, _signals_stop

    class Stub:
        should_exit = False

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with _signals_stop(Stub()):
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN  # as nohup left it
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        server = Stub()
        with _signals_stop(server):
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.05)
        assert server.should_exit  # the terminal closed: drain and exit 0, not die at once
    finally:
        signal.signal(signal.SIGHUP, previous)

    failed: list[str] = []

    class Engine:
        def fail_all(self, reason: str) -> None:
            failed.append(reason)

    loop = asyncio.new_event_loop()
    try:
        import uvicorn

        server = AnnouncingServer(uvicorn.Config(app=None), "m", False, Engine(), 5.0)
        server._loop = loop
        server.handle_exit(signal.SIGTERM, None)
        server.handle_exit(signal.SIGTERM, None)  # a second SIGTERM: the grace period goes on
        loop.run_until_complete(asyncio.sleep(0))
        assert failed == [] and server.should_exit and not server.force_exit
        server.handle_exit(signal.SIGINT, None)  # a second Ctrl-C: answered now
        loop.run_until_complete(asyncio.sleep(0))
        assert len(failed) == 1 and "a second signal" in failed[0] and not server.force_exit
        server.handle_exit(signal.SIGINT, None)  # a third: uvicorn forces the exit
        assert server.force_exit
    finally:
        loop.close()


def test_the_open_file_limit_is_raised_to_hold_the_connections(monkeypatch, capsys):
    """Under the usual soft limit of 1,024 files, 1,100 half-sent bodies exhausted them (accept()
    failing in a loop, /health timing out); serve now raises the soft limit up to the hard one and
    has uvicorn answer 503 past --max-connections, cutting them to what the limit holds if it must."""
    import resource

    from vlm_catalog.server import command

    limits = {"now": (1024, 1_048_576)}
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits["now"])

    def setrlimit(which, value):
        if value[0] > limits["now"][1]:
            raise ValueError("not allowed")
        limits["now"] = value

    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    assert command.connection_limit(2048) == 2048
    assert limits["now"] == (2048 + command.SPARE_FILE_DESCRIPTORS, 1_048_576)
    assert capsys.readouterr().err == ""
    limits["now"] = (1024, 1024)  # no room to raise it
    assert command.connection_limit(2048) == 1024 - command.SPARE_FILE_DESCRIPTORS
    assert "the open-file limit (1024) holds 768 connections, not --max-connections 2048" in capsys.readouterr().err
    limits["now"] = (65536, 65536)  # already enough: left alone
    assert command.connection_limit(2048) == 2048 and limits["now"] == (65536, 65536)
