"""`vlm-catalog bench --server-url` against a real `vlm-catalog serve` (a subprocess on a free port)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from vlm_catalog.bench.loadgen.report import ACCURACY_LOG_FILE, SUMMARY_FILE
from vlm_catalog.cli import main
from vlm_catalog.data.loader import load_catalogue
from vlm_catalog.paths import DEFAULT_MODEL_DIR, SAMPLE_CATALOGUE_DIR

SERVER_CAPACITY = 4  # --max-num-seqs 4 --max-waiting-requests 0: a fifth request at once gets 429
ANNOUNCEMENT = re.compile(r"vlm-catalog serving '(?P<model>[^']+)' at (?P<url>http://\S+)")
START_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def served():
    """(URL, model name) of `vlm-catalog serve --port 0` with the shipped model; stopped afterwards."""
    process = subprocess.Popen(
        [sys.executable, "-m", "vlm_catalog.cli", "serve", "--port", "0", "--log-level", "warning",
         "--max-num-seqs", str(SERVER_CAPACITY), "--max-waiting-requests", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    found: dict[str, str] = {}
    lines: list[str] = []
    ready = threading.Event()

    def read_output() -> None:
        for line in process.stdout:
            lines.append(line)
            match = ANNOUNCEMENT.search(line)
            if match and not found:
                found.update(match.groupdict())
                ready.set()
        ready.set()  # the process ended

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    try:
        ready.wait(START_TIMEOUT_S)
        if not found:
            pytest.fail("vlm-catalog serve did not start:\n" + "".join(lines[-30:]))
        yield found["url"], found["model"]
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        reader.join(5)


def bench(capsys, url: str, *args: str, max_in_flight: int = SERVER_CAPACITY) -> tuple[int, str, str]:
    code = main(["bench", "--dataset", str(SAMPLE_CATALOGUE_DIR), "--server-url", url,
                 "--max-in-flight", str(max_in_flight), *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_offline_accuracy_over_http_logs_the_servers_answers(served, tmp_path, capsys):
    from vlm_catalog import LLM

    url, model = served
    out_dir = tmp_path / "http-offline"
    code, out, err = bench(
        capsys, url, "--scenario", "offline", "--mode", "accuracy", "--out-dir", str(out_dir),
        "--count", "5", "--request-style", "ours",
    )
    assert code == 0, err
    entries = json.loads((out_dir / ACCURACY_LOG_FILE).read_text())
    logged = {entry["qsl_idx"]: bytes.fromhex(entry["data"]).decode() for entry in entries}
    assert sorted(logged) == list(range(5)) and len(entries) == 5
    # the server runs the same engine on the same constrained greedy requests as LLM.extract
    catalogue = load_catalogue(SAMPLE_CATALOGUE_DIR)
    expected = LLM(DEFAULT_MODEL_DIR).extract([catalogue[i] for i in range(5)])
    assert [logged[i] for i in range(5)] == [extraction.text for extraction in expected]
    assert (out_dir / "accuracy.txt").is_file()
    assert re.search(r"^offline accuracy: 5 samples in [\d.]+ s .* \(0 failed\)", out, re.M), out


def test_server_performance_over_http_streams_and_reports_ttft(served, tmp_path, capsys):
    url, model = served
    out_dir = tmp_path / "http-server"
    code, out, err = bench(
        capsys, url, "--scenario", "server", "--mode", "performance", "--out-dir", str(out_dir),
        "--count", "6", "--target-qps", "6", "--server-model", model, "--token-latencies", "--max-tokens", "60",
    )
    assert code == 0, err
    line = re.search(
        r"^server performance: (?P<qps>[\d.]+) queries/s at target 6.00; latency p50 (?P<p50>[\d.]+) s, "
        r"p99 (?P<p99>[\d.]+) s; TTFT p50 (?P<t50>[\d.]+) s, p99 (?P<t99>[\d.]+) s \(LoadGen\) \(0 failed\); "
        r"LoadGen: (VALID|INVALID)", out, re.M,
    )
    assert line, out
    assert 0 < float(line["t50"]) <= float(line["p99"]) and float(line["p50"]) <= float(line["p99"])
    summary = (out_dir / SUMMARY_FILE).read_text()
    assert "percentile first token latency (ns)" in summary
    assert "No errors encountered during test." in summary


def test_a_model_the_server_does_not_serve_is_refused_before_the_run(served, tmp_path, capsys):
    """Before, every request got a 404 and the run ended VALID with exit 0."""
    url, model = served
    code, out, err = bench(
        capsys, url, "--scenario", "offline", "--mode", "accuracy", "--out-dir", str(tmp_path / "wrong"),
        "--count", "2", "--server-model", "no-such-model",
    )
    assert code == 2 and err == f"error: --server-model 'no-such-model': {url}/v1 serves '{model}'\n"
    assert not (tmp_path / "wrong" / ACCURACY_LOG_FILE).exists()


def test_max_in_flight_keeps_the_offline_burst_within_the_servers_capacity(served, tmp_path, capsys):
    """Offline issues every sample at once: past the server's capacity it answers 429, unless the SUT holds them."""
    url, _ = served
    runs = {}
    for limit in (SERVER_CAPACITY, 4 * SERVER_CAPACITY):
        code, out, err = bench(
            capsys, url, "--scenario", "offline", "--mode", "performance", "--out-dir", str(tmp_path / str(limit)),
            "--count", str(4 * SERVER_CAPACITY), "--request-style", "ours", "--max-tokens", "20",
            max_in_flight=limit,
        )
        runs[limit] = int(re.search(r"\((\d+) failed\)", out).group(1))
        assert code == (1 if runs[limit] else 0), err  # a performance run with failed samples is not a result
    assert runs[SERVER_CAPACITY] == 0
    assert runs[4 * SERVER_CAPACITY] > 0  # the burst was refused (no retries: each counts as failed)
    assert "failed: sample" in err and "429" in err


def test_the_served_model_is_the_shipped_one(served):
    _, model = served
    assert model == Path(DEFAULT_MODEL_DIR).name
