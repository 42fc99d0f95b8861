"""The harness's parts: request styles, LoadGen settings, the QSL, failures, CLI errors."""

from __future__ import annotations

import base64
import io
import json
import socket

import mlperf_loadgen as lg
import pytest
from PIL import Image

from schemas import ProductMetadata, ProductRecord
from vlm_catalog.bench.loadgen.qsl import CatalogueQSL
from vlm_catalog.bench.loadgen.report import ACCURACY_LOG_FILE, parse_summary
from vlm_catalog.bench.loadgen.requests import (
    GREEDY,
    RequestStyleError,
    Sampling,
    prepare_request,
    style_sampling,
)
from vlm_catalog.bench.loadgen.responses import ResponseSink
from vlm_catalog.bench.loadgen.settings import (
    RunOptions,
    SettingsError,
    build_log_settings,
    build_test_settings,
)
from vlm_catalog.cli import main
from vlm_catalog.paths import DEFAULT_MODEL_DIR, SAMPLE_CATALOGUE_DIR
from vlm_catalog.preprocess.prompt import build_mlperf_messages, reencode_like_reference

CANDIDATES = ["Home & Garden > Lighting > Lamps", "Home & Garden > Decor"]


def jpeg(quality: int = 95, exif: bool = True) -> bytes:
    image = Image.new("RGB", (64, 48), (200, 120, 40))
    buffer = io.BytesIO()
    extra = {}
    if exif:
        data = Image.Exif()
        data[0x0112] = 6  # orientation
        extra["exif"] = data.tobytes()
    image.save(buffer, format="JPEG", quality=quality, **extra)
    return buffer.getvalue()


def record(image: bytes | None = None) -> ProductRecord:
    return ProductRecord(
        id="0", title="Desk lamp", description="<p>A lamp</p>", image=image or jpeg(), candidate_categories=CANDIDATES
    )


def image_url(messages) -> str:
    return messages[1]["content"][1]["image_url"]["url"]


# ---------------------------------------------------------------- request styles
def test_reencoding_is_pillows_default_save_in_the_images_own_format():
    original = jpeg(quality=95)
    image_format, data = reencode_like_reference(original)
    expected = io.BytesIO()
    Image.open(io.BytesIO(original)).save(expected, format="JPEG")  # what the reference does
    assert image_format == "JPEG" and data == expected.getvalue() and data != original
    assert "exif" not in Image.open(io.BytesIO(data)).info  # Pillow drops EXIF unless asked


def test_mlperf_style_is_the_reference_request_and_ours_the_constrained_one():
    product = record()
    mlperf = prepare_request(product, "mlperf")
    assert mlperf.schema is None  # no guided decoding
    _, reencoded = reencode_like_reference(product.image)
    assert image_url(mlperf.messages) == "data:image/JPEG;base64," + base64.b64encode(reencoded).decode()
    # everything but the image is the byte-exact mlperf prompt
    original = build_mlperf_messages(product)
    assert mlperf.messages[0] == original[0]
    assert mlperf.messages[1]["content"][0] == original[1]["content"][0]

    ours = prepare_request(product, "ours")
    assert ours.messages == original  # original image bytes, as LLM.extract sends
    assert ours.schema.json_schema["properties"]["category"]["enum"] == CANDIDATES
    assert ours.sampling_params(GREEDY, 150).greedy

    with pytest.raises(RequestStyleError, match="unknown request style"):
        prepare_request(product, "fancy")


def test_openai_arguments_of_both_styles():
    product = record()
    sampling = Sampling(temperature=0.7, top_p=0.8, top_k=20)
    mlperf = prepare_request(product, "mlperf").openai_arguments(sampling, 150, "m")
    assert mlperf["temperature"] == 0.7 and mlperf["top_p"] == 0.8 and mlperf["extra_body"] == {"top_k": 20}
    assert mlperf["max_tokens"] == 150 and mlperf["model"] == "m" and "response_format" not in mlperf
    ours = prepare_request(product, "ours").openai_arguments(GREEDY, 150, "m")
    assert ours["temperature"] == 0.0 and "extra_body" not in ours
    response_format = ours["response_format"]
    assert response_format["type"] == "json_schema" and response_format["json_schema"]["strict"] is True
    assert response_format["json_schema"]["schema"]["properties"]["category"]["enum"] == CANDIDATES
    json.dumps(ours)  # sendable as JSON


def test_mlperf_style_takes_the_checkpoints_sampling(tmp_path):
    checkpoint = tmp_path / "qwen"
    checkpoint.mkdir()
    (checkpoint / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20})
    )
    assert style_sampling("mlperf", checkpoint) == Sampling(temperature=0.7, top_p=0.8, top_k=20)
    assert style_sampling("ours", checkpoint) == GREEDY
    (checkpoint / "generation_config.json").write_text(json.dumps({"do_sample": True, "repetition_penalty": 1.05}))
    with pytest.raises(RequestStyleError, match="repetition_penalty = 1.05 is not supported"):
        style_sampling("mlperf", checkpoint)


# ---------------------------------------------------------------- settings
def test_defaults_are_the_benchmarks_settings():
    offline = build_test_settings(RunOptions("offline", "performance"), num_samples=48289)
    assert offline.scenario == lg.TestScenario.Offline and offline.mode == lg.TestMode.PerformanceOnly
    assert offline.min_duration_ms == 600_000 and offline.min_query_count == 48289
    assert offline.performance_sample_count_override == 48289
    assert offline.sample_concatenate_permutation and not offline.use_token_latencies
    server = build_test_settings(RunOptions("server", "accuracy"), num_samples=64)
    assert server.server_target_latency_ns == 12_000_000_000 and server.server_target_latency_percentile == 0.99
    assert server.min_duration_ms == 600_000 and server.mode == lg.TestMode.AccuracyOnly
    assert server.performance_sample_count_override == 64  # never more than the QSL holds


def test_count_and_duration_shorten_a_run():
    counted = build_test_settings(RunOptions("offline", "performance", count=8), 8)
    assert counted.min_query_count == 8 and counted.min_duration_ms == 0
    timed = build_test_settings(RunOptions("server", "performance", duration_s=2.5, target_qps=3), 64)
    assert timed.min_duration_ms == 2500 and timed.min_query_count == 1 and timed.server_target_qps == 3
    tokens = build_test_settings(RunOptions("server", "performance", count=2, token_latencies=True), 2)
    assert tokens.use_token_latencies and tokens.ttft_latency == tokens.server_target_latency_ns


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(scenario="multistream", mode="performance"), "--scenario must be one of"),
        (dict(scenario="offline", mode="fast"), "--mode must be one of"),
        (dict(scenario="offline", mode="performance", count=0), "--count must be between 1 and"),
        (dict(scenario="offline", mode="performance", duration_s=-1), "--duration must be a positive"),
        (dict(scenario="server", mode="performance", target_qps=0), "--target-qps must be positive"),
        # before, a traceback (inf, 1e300, 2^64: LoadGen's uint64 fields) or std::bad_alloc and a segfault (10^11)
        (dict(scenario="offline", mode="performance", count=10**11), "--count must be between 1 and 10,000,000"),
        (dict(scenario="offline", mode="performance", count=2**64), "--count must be between 1 and 10,000,000"),
        (dict(scenario="server", mode="performance", duration_s=float("inf")), "--duration .* at most 604,800"),
        (dict(scenario="server", mode="performance", duration_s=1e300), "--duration .* at most 604,800"),
        (dict(scenario="server", mode="performance", target_qps=float("inf")), "--target-qps must be positive"),
        (dict(scenario="server", mode="performance", target_qps=float("nan")), "--target-qps must be positive"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(SettingsError, match=message):
        RunOptions(**options)


def test_a_run_loadgen_could_not_schedule_is_refused():
    """LoadGen schedules every query before the run: rate x duration must stay allocatable."""
    options = RunOptions("server", "performance", duration_s=600, target_qps=100_000)
    with pytest.raises(SettingsError, match="about 60,000,000 queries .* lower --target-qps or --duration"):
        build_test_settings(options, 64)
    assert build_test_settings(RunOptions("server", "performance", duration_s=600, target_qps=10_000), 64)


# ---------------------------------------------------------------- a bad record
def test_a_record_that_cannot_be_prepared_fails_alone(tmp_path):
    """The QSL keeps the error; the SUT answers that sample with an empty response; the run goes on."""
    from vlm_catalog.bench.loadgen.sut_engine import EngineSUT
    from vlm_catalog.engine.config import EngineConfig
    from vlm_catalog.engine.llm_engine import LLMEngine

    records = [record(), record(image=b"this is not an image"), record(jpeg(quality=60, exif=False))]
    settings = build_test_settings(RunOptions("offline", "accuracy", count=3), 3)
    sink = ResponseSink(report_first_tokens=False)
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL_DIR))

    def prepare(product):
        return prepare_request(product, "ours")

    with CatalogueQSL(records, 3, 3, prepare) as qsl:
        with EngineSUT(engine, qsl, GREEDY, 40, sink) as sut:
            lg.StartTestWithLogSettings(sut.handle, qsl.handle, settings, build_log_settings(tmp_path))
        assert qsl.loaded == {}  # LoadGen unloaded every sample after the run
    engine.close()
    entries = {e["qsl_idx"]: bytes.fromhex(e["data"]).decode() for e in json.loads((tmp_path / ACCURACY_LOG_FILE).read_text())}
    assert entries[1] == ""
    for index in (0, 2):
        assert ProductMetadata.model_validate_json(entries[index]).category in CANDIDATES
    assert sink.tally.completed == 2 and sink.tally.failed == 1
    assert "cannot" in sink.tally.errors[0] and "sample 1" in sink.tally.errors[0]


def test_prompts_are_prepared_off_the_engine_thread_and_a_crash_there_fails_its_sample_alone(tmp_path, monkeypatch):
    """The SUT's pool prepares prompts (the engine thread only adds them); an unexpected error
    while preparing one (here a TypeError) answers that sample with an empty response."""
    import threading

    from vlm_catalog.bench.loadgen.sut_engine import EngineSUT
    from vlm_catalog.engine.config import EngineConfig
    from vlm_catalog.engine.llm_engine import LLMEngine

    crashing = ProductRecord(id="1", title="CRASH", description="", image=jpeg(), candidate_categories=CANDIDATES)
    records = [record(), crashing, record(jpeg(quality=60, exif=False))]
    settings = build_test_settings(RunOptions("offline", "accuracy", count=3), 3)
    sink = ResponseSink(report_first_tokens=False)
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL_DIR))
    process, threads = engine.processor.process, set()

    def watched_process(messages, *args, **kwargs):
        threads.add(threading.current_thread().name)
        if "CRASH" in json.dumps(messages):
            raise TypeError("an unexpected bug while preparing")
        return process(messages, *args, **kwargs)

    monkeypatch.setattr(engine.processor, "process", watched_process)
    with CatalogueQSL(records, 3, 3, lambda product: prepare_request(product, "ours")) as qsl:
        with EngineSUT(engine, qsl, GREEDY, 40, sink, prepare_workers=2) as sut:
            lg.StartTestWithLogSettings(sut.handle, qsl.handle, settings, build_log_settings(tmp_path))
    engine.close()
    assert threads and all(name.startswith("bench-prepare") for name in threads)
    entries = {e["qsl_idx"]: bytes.fromhex(e["data"]).decode() for e in json.loads((tmp_path / ACCURACY_LOG_FILE).read_text())}
    assert entries[1] == ""
    for index in (0, 2):
        assert ProductMetadata.model_validate_json(entries[index]).category in CANDIDATES
    assert sink.tally.completed == 2 and sink.tally.failed == 1
    assert "sample 1: an unexpected bug while preparing" in sink.tally.errors[0]


def test_an_offline_burst_is_prepared_only_as_far_ahead_as_prepare_ahead(tmp_path):
    """All 24 samples come in one call; at most `prepare_ahead` of them are ever being prepared or
    queued in the engine (the rest wait as bare indices), and every one is answered."""
    from vlm_catalog.bench.loadgen.sut_engine import EngineSUT
    from vlm_catalog.engine.config import EngineConfig
    from vlm_catalog.engine.llm_engine import LLMEngine

    records = [record(jpeg(quality=50 + i)) for i in range(24)]
    settings = build_test_settings(RunOptions("offline", "accuracy", count=24), 24)
    sink = ResponseSink(report_first_tokens=False)
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL_DIR, max_num_seqs=4))
    seen = {"ahead": 0, "held_back": 0}
    with CatalogueQSL(records, 24, 24, lambda product: prepare_request(product, "ours")) as qsl:
        with EngineSUT(engine, qsl, GREEDY, 12, sink, prepare_ahead=5) as sut:
            step = engine.step

            def watched_step():  # on the engine thread, which alone moves samples along
                seen["ahead"] = max(seen["ahead"], sut._num_preparing + engine.num_waiting_requests)
                seen["held_back"] = max(seen["held_back"], len(sut._issued))
                return step()

            engine.step = watched_step
            lg.StartTestWithLogSettings(sut.handle, qsl.handle, settings, build_log_settings(tmp_path))
    engine.close()
    assert sink.tally.completed == 24 and sink.tally.failed == 0
    assert 1 <= seen["ahead"] <= 5
    assert seen["held_back"] >= 24 - 5 - 4  # most of the burst waited unprepared at first


# ---------------------------------------------------------------- CLI errors
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--count", "0"], "error: --count must be between 1 and"),
        (["--duration", "inf"], "error: --duration must be a positive number of seconds"),
        (["--duration", "0"], "error: --duration must be a positive number of seconds"),
        (["--max-tokens", "0"], "error: --max-tokens must be at least 1"),
        (["--dataset", "/nonexistent/catalogue"], "error: "),
        (["--server-url", "ftp://x"], "error: --server-url must start with http:// or https://"),
        (["--gpu-memory-utilization", "0"], "error: gpu_memory_utilization must be in (0, 1], got 0.0"),
        (["--server-url", "http://127.0.0.1:{port}"], "error: no OpenAI-compatible server at http://127.0.0.1:"),
    ],
)
def test_bad_input_gets_a_one_line_error(tmp_path, capsys, args, message):
    args = [arg.replace("{port}", str(free_port())) for arg in args]
    base = ["bench", "--scenario", "offline", "--mode", "accuracy", "--dataset", str(SAMPLE_CATALOGUE_DIR),
            "--out-dir", str(tmp_path / "out")]
    code = main(base + args)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(message.split("{")[0]) and err.count("\n") == 1 and "Traceback" not in err


def test_out_dir_that_is_a_file_is_refused(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    code = main(["bench", "--scenario", "offline", "--mode", "accuracy", "--dataset", str(SAMPLE_CATALOGUE_DIR),
                 "--out-dir", str(target)])
    assert code == 2 and "exists and is not a folder" in capsys.readouterr().err


def test_summary_parser_reads_loadgens_fields(tmp_path):
    (tmp_path / "mlperf_log_summary.txt").write_text(
        "Scenario : Server\nMode     : PerformanceOnly\nCompleted samples per second    : 3.43\n"
        "Result is : INVALID\n  Early stopping satisfied: NO\n50.00 percentile latency (ns)   : 226015552\n"
        "99.00 percentile latency (ns)   : 1359824199\n99.00 percentile first token latency (ns)   : 5000\n"
    )
    summary = parse_summary(tmp_path / "mlperf_log_summary.txt")
    assert summary.scenario == "Server" and not summary.valid and summary.samples_per_second == 3.43
    assert summary.latency_percentiles_ns == {50.0: 226015552, 99.0: 1359824199}
    assert summary.first_token_percentiles_ns == {99.0: 5000}
    assert summary.fields["Early stopping satisfied"] == "NO"


def test_server_url_without_the_openai_package_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "openai", None)  # as if not installed (it is a dev dependency)
    monkeypatch.delitem(sys.modules, "vlm_catalog.bench.loadgen.sut_http", raising=False)
    code = main(["bench", "--scenario", "offline", "--mode", "accuracy", "--dataset", str(SAMPLE_CATALOGUE_DIR),
                 "--out-dir", str(tmp_path / "out"), "--server-url", "http://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --server-url needs the openai package") and err.count("\n") == 1


def test_the_overhead_script_times_every_way_on_a_thread_of_its_own():
    """bench runs its engine on its own thread; the overhead script ran extract's and the bare engine's on the
    main thread, which a busy machine slowed 2-10x (bench/extract 17 in one run): now all three alike."""
    import threading

    from vlm_catalog.bench.loadgen.overhead import on_a_thread

    assert on_a_thread(lambda a, b: (a + b, threading.current_thread().name), 2, 3) == (5, "overhead-engine")

    def fails():
        raise AssertionError("every record should be answered")

    with pytest.raises(AssertionError, match="every record"):
        on_a_thread(fails)
