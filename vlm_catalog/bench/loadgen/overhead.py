"""The harness's overhead: offline samples/s of `bench` against `extract` on the same records.

    python -m vlm_catalog.bench.loadgen.overhead --count 64 --repeats 3

Three ways to answer the same records with the same requests ("ours": the
per-record schema, greedy, 150 tokens), each with a fresh engine, interleaved
`--repeats` times; medians are printed, and the medians of the ratios of
runs made back to back (steadier on a shared machine):

- extract: `LLM.extract` timed as `vlm-catalog extract` times it (building the
  messages and schemas is inside the timer);
- engine: the requests `bench` would send, built beforehand, added straight
  to an `LLMEngine` and stepped until done (no LoadGen): the harness's floor;
- bench: `vlm-catalog bench --scenario offline --mode performance` (LoadGen's
  "Samples per second": first issue to last completion; requests are built
  when LoadGen loads the QSL, before the timed part, as MLPerf allows).

bench/engine is the harness's own overhead; bench/extract is what a user sees.
extract and engine run their engine on a thread of their own, as bench does
(its engine thread): on a busy machine an engine on the main thread ran 2-10x
slower than on another thread (PyTorch's OpenMP threads), which made
bench/extract 17 in one run. Both ratios swing with the machine's load; the steadiest measure of the overhead is
the share of LoadGen's measured duration the engine spent inside `add_request`
and `step` (the in-process SUT adds it up), printed for every bench run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from vlm_catalog.argument_types import positive_int
from vlm_catalog.paths import DEFAULT_MODEL_DIR, SAMPLE_CATALOGUE_DIR


def on_a_thread(function, *args):
    """`function(*args)` run on a new thread, as bench's engine runs: the same kind of thread for all three."""
    results, errors = [], []

    def run() -> None:
        try:
            results.append(function(*args))
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=run, name="overhead-engine")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return results[0]


def time_extract(records, model: Path, max_tokens: int) -> float:
    from vlm_catalog import LLM, SamplingParams

    llm = LLM(model)
    start = time.perf_counter()
    results = llm.extract(records, sampling_params=SamplingParams(max_tokens=max_tokens))
    seconds = time.perf_counter() - start
    llm.engine.close()
    assert all(result.ok for result in results), "every record should be answered"
    return len(records) / seconds


def time_engine(records, model: Path, max_tokens: int) -> float:
    from vlm_catalog.bench.loadgen.requests import GREEDY, prepare_request
    from vlm_catalog.engine.config import EngineConfig
    from vlm_catalog.engine.llm_engine import LLMEngine

    prepared = [prepare_request(record, "ours") for record in records]
    engine = LLMEngine(EngineConfig(model=model))
    start = time.perf_counter()
    for index, request in enumerate(prepared):
        engine.add_request(request.messages, request.sampling_params(GREEDY, max_tokens), request_id=str(index))
    finished = 0
    while engine.has_unfinished_requests():
        finished += sum(output.finished for output in engine.step())
    seconds = time.perf_counter() - start
    engine.close()
    assert finished == len(records)
    return len(records) / seconds


def time_bench(dataset: Path, count: int, model: Path, max_tokens: int, busy: list[float] | None = None) -> float:
    from vlm_catalog.bench.loadgen.harness import BenchConfig, run_benchmark
    from vlm_catalog.bench.loadgen.settings import RunOptions

    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as out_dir:
        result = run_benchmark(BenchConfig(
            RunOptions("offline", "performance", count=count), dataset, Path(out_dir), model=model,
            request_style="ours", max_tokens=max_tokens,
        ))
    assert result.tally.failed == 0 and result.tally.completed == count
    rate = result.summary.samples_per_second
    if busy is not None:  # share of LoadGen's measured duration spent inside the engine
        busy.append(result.tally.engine_busy_s / (count / rate))
    return rate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", type=Path, default=SAMPLE_CATALOGUE_DIR)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--count", type=positive_int, default=64)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--max-tokens", type=positive_int, default=150)
    args = parser.parse_args(argv)

    from vlm_catalog.data.format import CatalogueError
    from vlm_catalog.data.loader import load_catalogue

    try:
        catalogue = load_catalogue(args.dataset)
    except CatalogueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    count = min(args.count, len(catalogue))
    records = [catalogue[i] for i in range(count)]
    rates: dict[str, list[float]] = {"extract": [], "engine": [], "bench": []}
    busy: list[float] = []
    for repeat in range(args.repeats):
        rates["extract"].append(on_a_thread(time_extract, records, args.model, args.max_tokens))
        rates["engine"].append(on_a_thread(time_engine, records, args.model, args.max_tokens))
        rates["bench"].append(time_bench(args.dataset, count, args.model, args.max_tokens, busy))
        print(f"repeat {repeat + 1}: " + ", ".join(f"{name} {values[-1]:.2f}" for name, values in rates.items())
              + f" samples/s; bench: engine busy {busy[-1]:.1%} of LoadGen's duration", flush=True)
    median = {name: statistics.median(values) for name, values in rates.items()}
    print(f"{count} records, medians of {args.repeats}: " + ", ".join(
        f"{name} {value:.2f} samples/s" for name, value in median.items()))
    # ratios of runs made back to back share the machine's load; their median is steadier
    to_extract = statistics.median(b / e for b, e in zip(rates["bench"], rates["extract"]))
    to_engine = statistics.median(b / e for b, e in zip(rates["bench"], rates["engine"]))
    print(f"bench/extract = {median['bench'] / median['extract']:.3f} (median of paired ratios {to_extract:.3f}); "
          f"bench/engine (harness overhead) = {median['bench'] / median['engine']:.3f} "
          f"(median of paired ratios {to_engine:.3f})")
    print(f"bench: the engine was busy {statistics.median(busy):.2%} (median; min {min(busy):.2%}) of LoadGen's "
          "measured duration; the rest is the harness (LoadGen, issue, completion)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
