"""`vlm-catalog bench` when things go wrong: damaged labels, runs where nothing is answered, output
folders in the way, and servers that are not what `--server-url` promised (fake ones, in a thread)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.bench.test_loadgen_parts import free_port
from tests.conftest import jpeg_bytes
from vlm_catalog.bench.loadgen import sut_http
from vlm_catalog.bench.loadgen.report import ACCURACY_FILE, SUMMARY_FILE
from vlm_catalog.cli import main

CANDIDATES = ["Home & Garden > Lighting > Lamps", "Home & Garden > Decor"]
FAST = ["--max-tokens", "8", "--request-style", "ours"]


def jsonl_catalogue(folder: Path, rows: int = 3, changes: dict[int, dict] | None = None) -> Path:
    """`rows` labelled records in a JSONL file, each row changed by `changes[row]`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "lamp.jpg").write_bytes(jpeg_bytes((200, 120, 40)))
    lines = []
    for index in range(rows):
        row = {"title": f"Lamp {index}", "description": "A desk lamp.", "image": "lamp.jpg",
               "candidates": CANDIDATES, "category": CANDIDATES[0], "brand": "Lumo", "is_secondhand": False}
        row.update((changes or {}).get(index, {}))
        lines.append(json.dumps(row))
    path = folder / "records.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def bench(capsys, dataset: Path, out_dir: Path, *args: str) -> tuple[int, str, str]:
    code = main(["bench", "--dataset", str(dataset), "--out-dir", str(out_dir), *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ------------------------------------------------------------------ labels and failures
def test_a_damaged_label_fails_accuracy_mode_before_the_run_and_nothing_in_performance_mode(tmp_path, capsys):
    dataset = jsonl_catalogue(tmp_path / "data", changes={1: {"category": None}})
    out = tmp_path / "accuracy"
    code, _, err = bench(capsys, dataset, out, "--scenario", "offline", "--mode", "accuracy", *FAST)
    # before: found after the whole timed run, when scoring
    assert code == 2 and "record 1: ground_truth_category: expected a string" in err and err.count("\n") == 1
    assert not (out / SUMMARY_FILE).exists()  # LoadGen never started
    code, stdout, err = bench(capsys, dataset, tmp_path / "perf", "--scenario", "offline", "--mode", "performance",
                              "--count", "3", *FAST)
    assert code == 0, err
    assert "(0 failed)" in stdout  # before: the label failed the record's request


def test_a_run_where_every_sample_fails_exits_1(tmp_path, capsys):
    dataset = jsonl_catalogue(tmp_path / "data", rows=2, changes={0: {"image": "none.jpg"}, 1: {"image": "none.jpg"}})
    code, stdout, err = bench(capsys, dataset, tmp_path / "out", "--scenario", "offline", "--mode", "performance",
                              "--count", "2", *FAST)
    assert "(2 failed)" in stdout
    assert code == 1 and "error: every one of the 2 samples failed" in err
    assert "failed: sample 0: " in err and "not found" in err  # the failures name their sample


def test_token_latencies_need_two_tokens(tmp_path, capsys):
    dataset = jsonl_catalogue(tmp_path / "data")
    code, _, err = bench(capsys, dataset, tmp_path / "out", "--scenario", "server", "--mode", "performance",
                         "--token-latencies", "--max-tokens", "1")
    assert code == 2 and err.startswith("error: --token-latencies needs --max-tokens of at least 2")


def test_an_output_file_taken_by_a_folder_is_refused_and_a_failed_start_keeps_the_last_score(tmp_path, capsys):
    dataset = jsonl_catalogue(tmp_path / "data")
    out = tmp_path / "out"
    (out / SUMMARY_FILE).mkdir(parents=True)  # LoadGen aborted the process on it
    code, _, err = bench(capsys, dataset, out, "--scenario", "offline", "--mode", "performance", *FAST)
    assert code == 2 and err == f"error: --out-dir {out}: {SUMMARY_FILE} is a folder, where the run writes a file\n"

    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / ACCURACY_FILE).write_text("the last run's score\n")
    code, _, err = bench(capsys, dataset, kept, "--scenario", "offline", "--mode", "accuracy",
                         "--server-url", f"http://127.0.0.1:{free_port()}")
    assert code == 2 and "no OpenAI-compatible server" in err
    assert (kept / ACCURACY_FILE).read_text() == "the last run's score\n"  # before: deleted by the failed start


def test_a_refused_start_leaves_no_out_dir(tmp_path, capsys):
    """The out-dir is checked first and made only once the run can start: before, a model that does
    not load left an empty folder behind."""
    out = tmp_path / "new" / "bench"
    code, _, err = bench(capsys, jsonl_catalogue(tmp_path / "data"), out, "--scenario", "offline", "--mode",
                         "accuracy", "--model", str(tmp_path / "no-model"), *FAST)
    assert code == 2 and "config.json" in err
    assert not (tmp_path / "new").exists()


# ------------------------------------------------------------------ servers that misbehave
MODELS = {"object": "list", "data": [{"id": "served-model", "object": "model", "created": 0, "owned_by": "me"}]}


class FakeServer:
    """An HTTP server answering each path with `answer(handler)`; `url` while running."""

    def __init__(self, answer) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                answer(self)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                answer(self)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.shutdown()
        self.server.server_close()


def send(handler, status: int, body: bytes, content_type: str = "application/json") -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def completions_failing(status: int, body: bytes, after_s: float = 0.0):
    """A fake server's `answer` that lists the model and fails every completion with `status` after
    `after_s`; and the list that grows by one per completion request."""
    sent = []

    def answer(handler) -> None:
        if handler.path.endswith("/models"):
            send(handler, 200, json.dumps(MODELS).encode())
            return
        sent.append(1)
        time.sleep(after_s)
        send(handler, status, body)

    return answer, sent


def http_bench(capsys, tmp_path, url: str, *args: str) -> tuple[int, str, str]:
    dataset = jsonl_catalogue(tmp_path / "data", rows=2)
    return bench(capsys, dataset, tmp_path / "out", "--scenario", "offline", "--mode", "accuracy",
                 "--server-url", url, *args)


def test_a_server_model_the_server_does_not_list_is_refused_before_the_run(tmp_path, capsys):
    with FakeServer(lambda h: send(h, 200, json.dumps(MODELS).encode())) as server:
        code, _, err = http_bench(capsys, tmp_path, server.url, "--server-model", "nosuch")
    # before: every request got a 404, and the run said VALID with exit 0
    assert code == 2 and err == f"error: --server-model 'nosuch': {server.url}/v1 serves 'served-model'\n"


def test_a_server_that_is_not_openai_compatible_is_one_line(tmp_path, capsys):
    page = b"<!DOCTYPE html><html><body>Welcome</body></html>"
    with FakeServer(lambda h: send(h, 200, page, "text/html")) as server:
        code, _, err = http_bench(capsys, tmp_path, server.url)
    assert code == 2 and err.count("\n") == 1  # before: an AttributeError traceback
    assert err.startswith(f"error: {server.url}/v1 does not answer like an OpenAI-compatible server")


def test_a_keyed_server_gets_the_key_from_api_key_or_the_environment(tmp_path, capsys, monkeypatch):
    seen = []

    def keyed(handler) -> None:
        seen.append(handler.headers.get("Authorization"))
        if handler.headers.get("Authorization") != "Bearer sekrit":
            send(handler, 401, json.dumps({"error": {"message": "missing or wrong API key"}}).encode())
        else:
            send(handler, 200, json.dumps({"object": "list", "data": []}).encode())

    monkeypatch.delenv("VLM_CATALOG_API_KEY", raising=False)
    with FakeServer(keyed) as server:
        code, _, err = http_bench(capsys, tmp_path, server.url)
        assert code == 2 and err == f"error: {server.url}/v1 wants an API key: pass --api-key or set VLM_CATALOG_API_KEY\n"
        code, _, err = http_bench(capsys, tmp_path, server.url, "--api-key", "wrong")
        assert code == 2 and "and refused the one given" in err and "wrong" not in err.replace("wrong API", "")
        monkeypatch.setenv("VLM_CATALOG_API_KEY", "sekrit")
        code, _, err = http_bench(capsys, tmp_path, server.url)
        assert code == 2 and err == f"error: {server.url}/v1/models lists no model\n"  # the key was taken
    assert seen[-1] == "Bearer sekrit"


def test_a_stalled_server_fails_the_start_in_seconds(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sut_http, "_PROBE_TIMEOUT_S", 0.5)
    release = threading.Event()
    with FakeServer(lambda h: release.wait(30)) as server:
        started = time.monotonic()
        code, _, err = http_bench(capsys, tmp_path, server.url)
        release.set()
    assert code == 2 and "did not answer /models within" in err
    assert time.monotonic() - started < 10  # before: the samples' 3600 s timeout applied to the probe


def test_a_stream_cut_before_its_finish_is_a_failed_sample_not_a_partial_answer(tmp_path, capsys):
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "served-model",
             "choices": [{"index": 0, "delta": {"content": '{"cat'}, "finish_reason": None}]}

    def answer(handler) -> None:
        if handler.path.endswith("/models"):
            send(handler, 200, json.dumps(MODELS).encode())
            return
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Connection", "close")
        handler.end_headers()
        handler.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())  # then the connection closes

    dataset = jsonl_catalogue(tmp_path / "data", rows=2)
    with FakeServer(answer) as server:
        code, stdout, err = bench(capsys, dataset, tmp_path / "out", "--scenario", "server", "--mode", "accuracy",
                                  "--target-qps", "50", "--server-url", server.url)
    assert "(2 failed)" in stdout and "IncompleteStreamError" in err  # before: 0 failed, '{"cat' scored
    assert code == 1


def test_a_server_that_keeps_failing_stops_the_sending_and_every_failure_is_written(tmp_path, capsys, monkeypatch):
    """A hung or broken server ended a run only once every sample's request had failed on its own
    (with the default timeout of an hour, days for the benchmark's 48k samples); now the samples not
    yet sent fail at once after `SERVER_FAILURES_TO_STOP` server failures in a row. A performance run
    with failed samples exits 1 (LoadGen counts them as answered, at once), and failed_samples.json
    names each one; before, the run said VALID, exit 0, and the failures were on the console only."""
    monkeypatch.setattr(sut_http, "SERVER_FAILURES_TO_STOP", 3)
    answer, sent = completions_failing(500, b'{"error": {"message": "too late"}}', after_s=1.5)  # past the timeout

    dataset = jsonl_catalogue(tmp_path / "data", rows=12)
    with FakeServer(answer) as server:
        started = time.monotonic()
        code, stdout, err = bench(capsys, dataset, tmp_path / "out", "--scenario", "offline", "--mode", "performance",
                                  "--count", "12", "--max-in-flight", "2", "--request-timeout", "0.5",
                                  "--server-url", server.url, *FAST)
    assert time.monotonic() - started < 20
    assert "(12 failed)" in stdout and code == 1
    assert len(sent) <= 4  # 2 at a time: the third failure stops the sending
    assert "error: 12 of 12 samples failed" not in err and "every one of the 12 samples failed" in err
    failures = json.loads((tmp_path / "out" / "failed_samples.json").read_text())
    assert failures["failed"] == 12 and len(failures["reasons"]) == 12
    assert sum("APITimeoutError" in reason for reason in failures["reasons"]) >= 3
    assert any("not sent: the server failed 3 requests in a row, the last with APITimeoutError" in reason
               for reason in failures["reasons"])
    assert "... and 7 more, in" in err


def test_a_performance_run_with_some_failed_samples_is_not_a_result(tmp_path, capsys):
    dataset = jsonl_catalogue(tmp_path / "data", rows=3, changes={1: {"image": "none.jpg"}})
    out = tmp_path / "out"
    code, stdout, err = bench(capsys, dataset, out, "--scenario", "offline", "--mode", "performance", "--count", "3",
                              *FAST)
    assert "(1 failed)" in stdout and code == 1
    assert f"error: 1 of 3 samples failed (reasons above; all in {out / 'failed_samples.json'}): LoadGen counted " \
           "them as answered, so this is not a result" in err
    assert json.loads((out / "failed_samples.json").read_text())["reasons"][0].startswith("sample 1: ")
    dataset = jsonl_catalogue(tmp_path / "data", rows=3)  # fixed: the next run leaves no stale record
    code, stdout, _ = bench(capsys, dataset, out, "--scenario", "offline", "--mode", "performance", "--count", "3",
                            *FAST)
    assert code == 0 and "(0 failed)" in stdout and not (out / "failed_samples.json").exists()


def test_a_count_past_the_catalogue_and_a_bad_request_timeout_are_refused(tmp_path, capsys):
    dataset = jsonl_catalogue(tmp_path / "data", rows=3)
    code, _, err = bench(capsys, dataset, tmp_path / "out", "--scenario", "offline", "--mode", "performance",
                         "--count", "5", *FAST)
    assert code == 2 and f"error: --count 5 is more than the 3 records of {dataset}" in err  # before: 64 queries
    with FakeServer(lambda h: send(h, 200, json.dumps(MODELS).encode())) as server:
        code, _, err = http_bench(capsys, tmp_path, server.url, "--request-timeout", "0")
    assert code == 2 and "--request-timeout must be a positive number of seconds, got 0.0" in err


def test_a_full_server_does_not_stop_the_sending(tmp_path, capsys, monkeypatch):
    """A 429 is a full server (`--max-in-flight` above its capacity), not a broken one: counted as a
    server failure, a burst of them stopped the sending, and samples the server would have answered
    later were failed unsent."""
    monkeypatch.setattr(sut_http, "SERVER_FAILURES_TO_STOP", 3)
    answer, sent = completions_failing(429, b'{"error": {"message": "the service is at capacity", "code": "server_busy"}}')

    dataset = jsonl_catalogue(tmp_path / "data", rows=8)
    with FakeServer(answer) as server:
        code, stdout, _ = bench(capsys, dataset, tmp_path / "out", "--scenario", "offline", "--mode", "performance",
                                "--count", "8", "--max-in-flight", "2", "--server-url", server.url, *FAST)
    reasons = json.loads((tmp_path / "out" / "failed_samples.json").read_text())["reasons"]
    assert code == 1 and "(8 failed)" in stdout and len(sent) == 8
    assert all("RateLimitError" in reason for reason in reasons) and not any("not sent" in r for r in reasons)
