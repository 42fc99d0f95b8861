"""Reading LoadGen's summary log, and scoring its accuracy log as the reference does.

`parse_summary` reads `mlperf_log_summary.txt`: the scenario's throughput
("Samples per second" Offline, "Completed samples per second" Server), the
latency percentiles, the first-token percentiles when the run used token
latencies, and LoadGen's verdict ("Result is : VALID").

`write_accuracy` scores `mlperf_log_accuracy.json` with `vlm-catalog eval`'s
code (`evaluate.predictions` + `evaluate.scoring`) and writes `accuracy.txt`
in the reference's layout: "Results", the JSON `{"f1": <category hF1>}`
(sorted keys) and `hash=<sha256 of that JSON>`.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from vlm_catalog.batch.output import JOB_SUFFIX

SUMMARY_FILE = "mlperf_log_summary.txt"
DETAIL_FILE = "mlperf_log_detail.txt"
ACCURACY_LOG_FILE = "mlperf_log_accuracy.json"
ACCURACY_FILE = "accuracy.txt"
ACCURACY_JSON_FILE = "accuracy.json"
# every file a run writes in --out-dir: LoadGen's logs (prefix "mlperf_log_"), then our scores
# which records the accuracy log's qsl_idx are rows of (the split and its size), in the job file `extract`
# writes beside its results, so `vlm-catalog eval` refuses to score the log against another selection
ACCURACY_LOG_JOB_FILE = ACCURACY_LOG_FILE + JOB_SUFFIX
# the samples that failed (each answered "" to LoadGen, which counts it as done), written when any did
FAILURES_FILE = "failed_samples.json"
OUTPUT_FILES = (SUMMARY_FILE, DETAIL_FILE, ACCURACY_LOG_FILE, "mlperf_log_trace.json", ACCURACY_FILE, ACCURACY_JSON_FILE,
                ACCURACY_LOG_JOB_FILE, FAILURES_FILE)

_FIELD = re.compile(r"^\s*(?P<key>[^:]+?)\s*:\s*(?P<value>\S.*?)\s*$")
_PERCENTILE = re.compile(r"^(?P<p>[\d.]+) percentile (?P<first>first token )?latency \(ns\)$")


class SummaryError(ValueError):
    """LoadGen's summary log is missing or does not have the expected fields."""


@dataclass
class LoadGenSummary:
    scenario: str
    mode: str
    valid: bool
    samples_per_second: float | None = None  # Offline: samples/s; Server: completed queries/s
    latency_percentiles_ns: dict[float, int] = field(default_factory=dict)
    first_token_percentiles_ns: dict[float, int] = field(default_factory=dict)
    fields: dict[str, str] = field(default_factory=dict)  # every "key : value" line


def parse_summary(path: Path) -> LoadGenSummary:
    if not path.is_file():
        raise SummaryError(f"LoadGen wrote no summary log at {path}")
    fields: dict[str, str] = {}
    latency: dict[float, int] = {}
    first_token: dict[float, int] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        match = _FIELD.match(line)
        if not match:
            continue
        key, value = match["key"], match["value"]
        fields.setdefault(key, value)
        percentile = _PERCENTILE.match(key)
        if percentile:
            target = first_token if percentile["first"] else latency
            target[float(percentile["p"])] = int(value)
    try:
        scenario, mode, verdict = fields["Scenario"], fields["Mode"], fields["Result is"]
    except KeyError as exc:
        raise SummaryError(f"{path}: no {exc.args[0]!r} line") from None
    throughput_key = "Samples per second" if scenario == "Offline" else "Completed samples per second"
    throughput = fields.get(throughput_key)
    return LoadGenSummary(
        scenario=scenario,
        mode=mode,
        valid=verdict == "VALID",
        samples_per_second=float(throughput) if throughput is not None else None,
        latency_percentiles_ns=latency,
        first_token_percentiles_ns=first_token,
        fields=fields,
    )


def accuracy_log_entries(path: Path) -> list[dict]:
    """The accuracy log's entries (`seq_id`, `qsl_idx`, `data` = hex of the UTF-8 response)."""
    return json.loads(path.read_text(encoding="utf-8"))


def accuracy_txt(category_hf1: float) -> str:
    """`accuracy.txt` as the reference writes it."""
    data = json.dumps({"f1": category_hf1}, sort_keys=True)
    digest = hashlib.sha256(data.encode()).hexdigest()
    return f"Results\n\n{data}\n\nhash={digest}"


def write_accuracy(out_dir: Path, catalogue, seed: int = 12345, labels=None):
    """Score the run's accuracy log against `catalogue`; write accuracy.txt/.json; return the report.
    `labels`: the catalogue's labels, when the caller has read (and checked) them already."""
    from vlm_catalog.evaluate.command import resolve_indices
    from vlm_catalog.evaluate.predictions import read_predictions
    from vlm_catalog.evaluate.scoring import score

    predictions = read_predictions(out_dir / ACCURACY_LOG_FILE)
    responses = resolve_indices(predictions, catalogue)
    if labels is None:
        labels = catalogue.labels(scored=(index for index, _ in responses))
    report = score(responses, labels, seed=seed)
    (out_dir / ACCURACY_FILE).write_text(accuracy_txt(report.category_hf1), encoding="utf-8")
    (out_dir / ACCURACY_JSON_FILE).write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
    return report
