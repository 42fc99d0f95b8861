"""Progress lines off a terminal, and how an engine output becomes a result line."""

import io

from schemas import ProductMetadata
from vlm_catalog.batch.progress import Progress
from vlm_catalog.batch.requests import RequestBuilder, ResultLine
from vlm_catalog.engine.outputs import RequestOutput


def test_progress_logs_rates_failures_and_eta_when_not_on_a_terminal():
    stream = io.StringIO()
    progress = Progress(4, terminal=False, log_every_s=0.0, stream=stream)
    progress.update(ResultLine(id="0", num_tokens=30))
    progress.update(ResultLine.failed("1", "image", "bad"))
    logged = stream.getvalue().splitlines()
    assert len(logged) == 2
    assert logged[-1].startswith("progress: 2/4 records (50.0%)")
    assert "records/s" in logged[-1] and "tokens/s" in logged[-1] and "1 failed" in logged[-1] and "ETA" in logged[-1]
    assert progress.answered == 1 and progress.failures == {"image": 1} and progress.tokens == 30


def output(text, finish_reason, error=None, tokens=3):
    return RequestOutput("r", text, list(range(tokens)), 10, True, finish_reason, error)


def test_result_lines_classify_each_way_a_record_can_fail():
    builder = RequestBuilder(ProductMetadata, "mlperf", 150, len)
    good = builder.result("7", output('{"category":"A","brand":"B","is_secondhand":false}', "stop"))
    assert good.failure is None and good.parsed == {"category": "A", "brand": "B", "is_secondhand": False}
    assert set(good.to_json()) == {"id", "response", "parsed", "finish_reason", "error", "metrics", "failure"}
    cut = builder.result("7", output('{"category":"A","bra', "length", tokens=150))
    assert cut.failure == "length" and "cut at 150 tokens" in cut.error and cut.parsed is None
    wrong = builder.result("7", output('{"category":"A"}', "stop"))
    assert wrong.failure == "answer" and "does not validate" in wrong.error
    image = builder.result("7", output("", "error", "PNG pixel data is truncated or corrupt: x [truncated]"))
    assert image.failure == "image"
    engine = builder.result("7", output("", "error", "the prompt has 9999 tokens; max_model_len is 4096"))
    assert engine.failure == "engine"
