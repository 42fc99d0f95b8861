"""`vlm-catalog bench` end to end on the real LoadGen and the shipped model (a few seconds each)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vlm_catalog.bench.loadgen.report import (
    ACCURACY_LOG_FILE,
    DETAIL_FILE,
    SUMMARY_FILE,
    accuracy_txt,
)
from vlm_catalog.bench.loadgen.requests import prepare_request
from vlm_catalog.cli import main
from vlm_catalog.data.loader import load_catalogue
from vlm_catalog.evaluate.scoring import score
from vlm_catalog.paths import DEFAULT_MODEL_DIR, SAMPLE_CATALOGUE_DIR

OFFLINE_LINE = re.compile(
    r"^offline (?P<mode>\w+): (?P<n>\d+) samples in (?P<s>[\d.]+) s \((?P<rate>[\d.]+) samples/s, SUT clock\) "
    r"\((?P<failed>\d+) failed\)", re.M,
)
SERVER_LINE = re.compile(
    r"^server performance: (?P<qps>[\d.]+) queries/s at target (?P<target>[\d.]+); "
    r"latency p50 (?P<p50>[\d.]+) s, p99 (?P<p99>[\d.]+) s; "
    r"TTFT p50 (?P<t50>[\d.]+) s, p99 (?P<t99>[\d.]+) s \((?P<clock>LoadGen|SUT clock)\) "
    r"\((?P<failed>\d+) failed\); LoadGen: (?P<verdict>VALID|INVALID)", re.M,
)
PERF_OFFLINE_LINE = re.compile(
    r"^offline performance: (?P<rate>[\d.]+) samples/s over (?P<n>\d+) samples \((?P<failed>\d+) failed\); "
    r"engine busy (?P<busy>[\d.]+)% of the run; LoadGen: (?P<verdict>VALID|INVALID)", re.M,
)


def bench(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["bench", "--dataset", str(SAMPLE_CATALOGUE_DIR), *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def accuracy_log(out_dir: Path) -> dict[int, str]:
    entries = json.loads((out_dir / ACCURACY_LOG_FILE).read_text())
    indices = [entry["qsl_idx"] for entry in entries]
    assert len(indices) == len(set(indices)), "one entry per sample"
    return {entry["qsl_idx"]: bytes.fromhex(entry["data"]).decode("utf-8") for entry in entries}


@pytest.mark.parametrize("engine_flags", [(), ("--async-scheduling",)])
def test_offline_accuracy_run_logs_the_engines_answers_and_writes_accuracy_txt(tmp_path, capsys, engine_flags):
    from vlm_catalog import LLM

    out_dir = tmp_path / "offline"
    code, out, err = bench(
        capsys, "--scenario", "offline", "--mode", "accuracy", "--out-dir", str(out_dir),
        "--count", "6", "--request-style", "ours", *engine_flags,
    )
    assert code == 0, err
    for name in (SUMMARY_FILE, DETAIL_FILE, ACCURACY_LOG_FILE):
        assert (out_dir / name).is_file(), name
    logged = accuracy_log(out_dir)
    assert sorted(logged) == list(range(6))

    # "ours" is what LLM.extract sends: the same records give the same answers (greedy, batch-invariant;
    # with async scheduling too)
    catalogue = load_catalogue(SAMPLE_CATALOGUE_DIR)
    expected = LLM(DEFAULT_MODEL_DIR).extract([catalogue[i] for i in range(6)])
    assert [logged[i] for i in range(6)] == [extraction.text for extraction in expected]
    assert all(extraction.ok for extraction in expected)

    report = score(sorted(logged.items()), catalogue.labels())
    assert (out_dir / "accuracy.txt").read_text() == accuracy_txt(report.category_hf1)
    assert f"category hF1 {report.category_hf1:.4f}" in out

    line = OFFLINE_LINE.search(out)
    assert line, out
    assert line["mode"] == "accuracy" and int(line["n"]) == 6 and int(line["failed"]) == 0
    assert float(line["rate"]) > 0


def test_mlperf_style_sends_the_reference_request_and_logs_its_answers(tmp_path, capsys):
    from vlm_catalog import LLM, SamplingParams

    out_dir = tmp_path / "mlperf"
    code, out, err = bench(
        capsys, "--scenario", "offline", "--mode", "accuracy", "--out-dir", str(out_dir), "--count", "3",
        "--max-tokens", "40",
    )
    assert code == 0, err
    logged = accuracy_log(out_dir)
    catalogue = load_catalogue(SAMPLE_CATALOGUE_DIR)
    # the shipped checkpoint's generation_config.json says do_sample: false, so the reference's
    # request is greedy, unconstrained, on the re-encoded image
    messages = [prepare_request(catalogue[i], "mlperf").messages for i in range(3)]
    expected = LLM(DEFAULT_MODEL_DIR).chat(messages, SamplingParams(max_tokens=40, temperature=0.0))
    assert [logged[i] for i in range(3)] == [output.text for output in expected]
    assert (out_dir / "accuracy.txt").read_text().startswith('Results\n\n{"f1": ')


@pytest.mark.parametrize("token_latencies", [False, True], ids=["benchmark-settings", "token-latencies"])
def test_server_performance_run_reports_rate_latency_and_ttft(tmp_path, capsys, token_latencies):
    out_dir = tmp_path / "server"
    extra = ["--token-latencies"] if token_latencies else []
    code, out, err = bench(
        capsys, "--scenario", "server", "--mode", "performance", "--out-dir", str(out_dir),
        "--count", "8", "--target-qps", "8", "--request-style", "ours", *extra,
    )
    assert code == 0, err
    summary = (out_dir / SUMMARY_FILE).read_text()
    assert "Scenario : Server" in summary and "Mode     : PerformanceOnly" in summary
    line = SERVER_LINE.search(out)
    assert line, out
    assert float(line["target"]) == 8.0 and float(line["qps"]) > 0
    assert 0 < float(line["p50"]) <= float(line["p99"])
    assert 0 < float(line["t50"]) <= float(line["t99"]) <= float(line["p99"]) + 1e-3
    assert line["clock"] == ("LoadGen" if token_latencies else "SUT clock")
    assert int(line["failed"]) == 0
    verdict = re.search(r"Result is : (VALID|INVALID)", summary).group(1)
    assert line["verdict"] == verdict
    if token_latencies:
        assert "percentile first token latency (ns)" in summary
    assert "No errors encountered during test." in summary  # first tokens reported before completions


def test_offline_performance_run_prints_loadgens_samples_per_second(tmp_path, capsys):
    out_dir = tmp_path / "perf"
    code, out, err = bench(
        capsys, "--scenario", "offline", "--mode", "performance", "--out-dir", str(out_dir),
        "--count", "4", "--request-style", "ours", "--max-tokens", "30",
    )
    assert code == 0, err
    line = PERF_OFFLINE_LINE.search(out)
    assert line, out
    summary = (out_dir / SUMMARY_FILE).read_text()
    logged_rate = float(re.search(r"Samples per second: ([\d.e+]+)", summary).group(1))
    assert float(line["rate"]) == pytest.approx(logged_rate, rel=0.01)
    assert 0 < float(line["busy"]) <= 100  # engine time inside LoadGen's measured duration
    assert int(line["n"]) == 4 and line["verdict"] == re.search(r"Result is : (\w+)", summary).group(1)
    assert json.loads((out_dir / ACCURACY_LOG_FILE).read_text()) == []  # nothing sampled in performance mode
    assert not (out_dir / "accuracy.txt").exists()


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_ctrl_c_ends_a_loadgen_run_at_once(tmp_path, stop):
    """LoadGen's C++ run (600 s with the benchmark's settings) cannot be stopped; Ctrl-C ends the process,
    and SIGTERM too (before, it killed the process without a word, exit -15)."""
    import signal
    import subprocess
    import sys
    import time

    out_dir = tmp_path / "interrupted"
    process = subprocess.Popen(
        [sys.executable, "-m", "vlm_catalog.cli", "bench", "--scenario", "offline", "--mode", "performance",
         "--dataset", str(SAMPLE_CATALOGUE_DIR), "--out-dir", str(out_dir), "--request-style", "ours"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as in a terminal
    )
    try:
        deadline = time.monotonic() + 120
        while not (out_dir / DETAIL_FILE).is_file():  # LoadGen has started
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.2)
        time.sleep(1.0)
        process.send_signal(getattr(signal, stop))
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130
    assert err.strip() == f"error: interrupted; the LoadGen logs in {out_dir} are incomplete"


def test_an_accuracy_log_of_one_split_is_not_scored_against_another(tmp_path, capsys):
    """Each qsl_idx is a row of the --split the run used; `eval` without it met the train split's labels
    and printed hF1 0.0000 with exit 0. The run now records its selection beside the log, as extract does."""
    from tests.conftest import handmade_rows, write_catalogue

    rows = handmade_rows()
    write_catalogue(tmp_path / "shop", rows[:2], split="train")
    write_catalogue(tmp_path / "shop", rows[2:], split="test")
    dataset, out_dir = str(tmp_path / "shop"), tmp_path / "run"
    code = main(["bench", "--scenario", "offline", "--mode", "accuracy", "--dataset", dataset, "--split", "test",
                 "--out-dir", str(out_dir), "--request-style", "ours", "--max-tokens", "60"])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    log = str(out_dir / ACCURACY_LOG_FILE)
    assert main(["eval", "--predictions", log, "--dataset", dataset]) == 2
    assert "was made with --split test (mlperf_log_accuracy.json.job.json)" in capsys.readouterr().err
    assert main(["eval", "--predictions", log, "--dataset", dataset, "--split", "test"]) == 0
