"""One `vlm-catalog bench` run: catalogue -> QSL, engine or server -> SUT, LoadGen, logs, accuracy.

    result = run_benchmark(BenchConfig(RunOptions("offline", "accuracy", count=8), dataset, out_dir))
    result.summary.samples_per_second, result.summary.valid, result.accuracy.category_hf1

Everything that can be checked before LoadGen starts is (options, dataset,
ground truth for accuracy mode, the output folder, the server's answer), so a
bad run fails in seconds with a message, not after the timed part.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlperf_loadgen as lg

from vlm_catalog.atomic_files import write_atomically
from vlm_catalog.bench.loadgen.qsl import CatalogueQSL
from vlm_catalog.bench.loadgen.report import (
    ACCURACY_FILE,
    ACCURACY_JSON_FILE,
    ACCURACY_LOG_JOB_FILE,
    FAILURES_FILE,
    OUTPUT_FILES,
    SUMMARY_FILE,
    LoadGenSummary,
    parse_summary,
    write_accuracy,
)
from vlm_catalog.bench.loadgen.requests import (
    REQUEST_STYLES,
    RequestStyleError,
    prepare_request,
    style_sampling,
)
from vlm_catalog.bench.loadgen.responses import ResponseSink, RunTally
from vlm_catalog.bench.loadgen.settings import RunOptions, build_log_settings, build_test_settings
from vlm_catalog.folders import check_folder_can_be_made
from vlm_catalog.paths import DEFAULT_MODEL_DIR


class BenchError(ValueError):
    """A run that cannot start (bad options, unusable dataset or output folder); the message says why."""


@dataclass(frozen=True)
class BenchConfig:
    options: RunOptions
    dataset: Path
    out_dir: Path
    model: Path = DEFAULT_MODEL_DIR
    split: str | None = None
    request_style: str = "mlperf"
    max_tokens: int = 150
    server_url: str | None = None
    server_model: str | None = None  # default: the first model the server lists
    server_api_key: str | None = field(default=None, repr=False)  # a `serve --api-key` server's key
    max_in_flight: int = 512  # HTTP requests sent at once
    request_timeout_s: float = 3600.0  # one HTTP request at most
    device: str = "cpu"
    dtype: str = "auto"
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    quantization: str = "auto"
    async_scheduling: bool | None = None  # EngineConfig.async_scheduling (None: on CUDA only)
    warmup: bool | None = None  # EngineConfig.warmup (None: on CUDA only)


@dataclass
class BenchResult:
    summary: LoadGenSummary | None  # LoadGen's performance summary (None in accuracy mode: it writes none)
    tally: RunTally
    num_samples: int
    target_qps: float
    loadgen_seconds: float  # wall time of StartTest (includes loading the QSL)
    accuracy: object | None = None  # evaluate.scoring.AccuracyReport in accuracy mode


def run_benchmark(config: BenchConfig) -> BenchResult:
    from vlm_catalog.data.loader import load_catalogue

    options = config.options
    if config.request_style not in REQUEST_STYLES:
        raise BenchError(f"--request-style must be one of {', '.join(REQUEST_STYLES)}, got {config.request_style!r}")
    if config.max_tokens < 1:
        raise BenchError(f"--max-tokens must be at least 1, got {config.max_tokens}")
    catalogue = load_catalogue(config.dataset, split=config.split)
    if len(catalogue) == 0:
        raise BenchError(f"{config.dataset}: holds no records")
    if config.max_tokens < 2 and options.token_latencies:
        raise BenchError("--token-latencies needs --max-tokens of at least 2 (LoadGen's TPOT divides by tokens - 1)")
    if options.mode == "accuracy" and not catalogue.has_labels:
        raise BenchError(f"{config.dataset}: accuracy mode needs ground truth columns, and this catalogue has none")
    if options.count is not None and options.count > len(catalogue):  # LoadGen would repeat samples to make up --count
        raise BenchError(f"--count {options.count} is more than the {len(catalogue)} records of {config.dataset}"
                         + (f" (--split {config.split})" if config.split else ""))
    num_samples = options.count if options.count is not None else len(catalogue)
    labels = None
    if options.mode == "accuracy":  # read and checked now: a damaged label fails before the timed run
        labels = catalogue.labels(scored=range(num_samples))
    else:  # labels play no part in a timed run: a damaged one must not fail its record's request
        catalogue = catalogue.inputs_only()
    try:
        sampling = style_sampling(config.request_style, config.model)
    except RequestStyleError as exc:
        raise BenchError(str(exc)) from None
    _check_out_dir(config.out_dir)
    settings = build_test_settings(options, num_samples)
    sink = ResponseSink(report_first_tokens=options.scenario == "server")

    def prepare(record):
        return prepare_request(record, config.request_style)

    with contextlib.ExitStack() as stack:
        qsl = stack.enter_context(
            CatalogueQSL(catalogue, num_samples, settings.performance_sample_count_override, prepare)
        )
        sut, engine = _make_sut(config, qsl, sampling, sink)
        if engine is not None:
            stack.callback(engine.close)
        stack.enter_context(sut)
        _remove_stale_results(config.out_dir)  # only once the run can start: a failed start keeps the last score
        _record_selection(config.out_dir, config.split, len(catalogue))
        start = time.perf_counter()
        try:
            _start_test(sut.handle, qsl.handle, settings, build_log_settings(config.out_dir))
        except Interrupted:
            stack.pop_all()  # LoadGen still runs and holds the SUT and QSL: no teardown
            raise
        seconds = time.perf_counter() - start
    _write_failures(config.out_dir, sink.tally)
    summary = parse_summary(config.out_dir / SUMMARY_FILE) if options.mode == "performance" else None
    target_qps = settings.server_target_qps if options.scenario == "server" else settings.offline_expected_qps
    result = BenchResult(summary, sink.tally, num_samples, target_qps, seconds)
    if options.mode == "accuracy":
        result.accuracy = write_accuracy(config.out_dir, catalogue, labels=labels)
    return result


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during LoadGen's run: LoadGen cannot be stopped, so the process must exit (os._exit)."""


def _start_test(sut, qsl, settings, log_settings) -> None:
    """`lg.StartTestWithLogSettings` in a thread, so Ctrl-C reaches this (main) thread.

    LoadGen blocks in C++ until its run ends (600 s by default) and Python
    handles signals only between bytecodes of the main thread, so a run
    started on the main thread ignores Ctrl-C. Here the main thread waits in
    short joins; on Ctrl-C it raises `Interrupted`, and the caller must end the
    process without waiting for LoadGen (its logs are then incomplete).
    """
    errors: list[BaseException] = []

    def run() -> None:
        try:
            lg.StartTestWithLogSettings(sut, qsl, settings, log_settings)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)

    thread = threading.Thread(target=run, name="loadgen", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.2)
    except KeyboardInterrupt:
        raise Interrupted() from None
    if errors:
        raise errors[0]


def _check_out_dir(out_dir: Path) -> None:
    """The output folder is writable, or can be made (it is made once the run can start, so a
    refused start leaves none), and no file the run writes is taken by a folder (LoadGen aborts the
    process on a log it cannot open)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise BenchError(f"--out-dir {out_dir} exists and is not a folder")
    try:
        check_folder_can_be_made(out_dir, ".bench-write-check")
    except OSError as exc:
        raise BenchError(f"--out-dir {out_dir} is not writable: {exc.strerror or exc}") from None
    for name in OUTPUT_FILES:
        if (out_dir / name).is_dir():
            raise BenchError(f"--out-dir {out_dir}: {name} is a folder, where the run writes a file")


def _remove_stale_results(out_dir: Path) -> None:
    for stale in (ACCURACY_FILE, ACCURACY_JSON_FILE, FAILURES_FILE):  # from an earlier run
        (out_dir / stale).unlink(missing_ok=True)


def _write_failures(out_dir: Path, tally) -> None:
    """Every failed sample's reason, in FAILURES_FILE: LoadGen's own logs say nothing of them (a
    failed sample completes at once with an empty answer, which a performance run counts as done)."""
    if not tally.failed:
        return
    record = {"samples": tally.samples, "failed": tally.failed, "reasons": tally.errors}
    try:
        write_atomically(out_dir / FAILURES_FILE, json.dumps(record, indent=1) + "\n")
    except OSError as exc:
        raise BenchError(f"--out-dir {out_dir}: cannot write {FAILURES_FILE}: {exc.strerror or exc}") from None


def _record_selection(out_dir: Path, split: str | None, num_records: int) -> None:
    """Write which records the accuracy log's `qsl_idx` are rows of, where `vlm-catalog eval` looks
    (`mlperf_log_accuracy.json.job.json`): scored with another --split, or on a catalogue of another
    size, the log's answers would meet other records' labels and score silently wrong."""
    selection = {"written_by": "vlm-catalog bench", "split": split, "num_records": num_records}
    try:
        out_dir.mkdir(parents=True, exist_ok=True)  # checked before; made only once the run can start
        write_atomically(out_dir / ACCURACY_LOG_JOB_FILE, json.dumps(selection, indent=2) + "\n")
    except OSError as exc:  # e.g. a full disk
        raise BenchError(f"--out-dir {out_dir}: cannot write {ACCURACY_LOG_JOB_FILE}: {exc.strerror or exc}") from None


def _make_sut(config: BenchConfig, qsl: CatalogueQSL, sampling, sink: ResponseSink):
    """(SUT, engine to close or None): the HTTP client with --server-url, else the in-process engine."""
    if config.server_url is not None:
        try:
            from vlm_catalog.bench.loadgen.sut_http import HttpSUT
        except ImportError as exc:  # openai is a development dependency today
            raise BenchError(f"--server-url needs the openai package (pip install openai): {exc}") from None

        try:
            sut = HttpSUT(
                config.server_url, config.server_model, qsl, sampling, config.max_tokens, sink,
                stream=config.options.scenario == "server", max_in_flight=config.max_in_flight,
                api_key=config.server_api_key, timeout_s=config.request_timeout_s,
            )
        except ValueError as exc:
            raise BenchError(str(exc)) from None
        return sut, None
    from vlm_catalog.bench.loadgen.sut_engine import EngineSUT
    from vlm_catalog.engine.arguments import DEVICE_OPTIONS
    from vlm_catalog.engine.config import EngineConfig
    from vlm_catalog.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(
        model=config.model, device=config.device, dtype=config.dtype,
        enable_prefix_caching=config.enable_prefix_caching, scheduling_policy=config.scheduling_policy,
        **{name: getattr(config, name) for name in DEVICE_OPTIONS},
    ))
    return EngineSUT(engine, qsl, sampling, config.max_tokens, sink), engine
