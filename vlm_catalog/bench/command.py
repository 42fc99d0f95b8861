"""`vlm-catalog bench`: the MLPerf LoadGen harness (Offline and Server scenarios).

Runs LoadGen (`mlperf_loadgen`) against the in-process engine, or against a
running `vlm-catalog serve` with `--server-url`, writes LoadGen's logs into
`--out-dir`, scores the accuracy log in accuracy mode (accuracy.txt as the
reference writes it) and prints the result line, e.g.

    offline performance: 12.10 samples/s over 64 samples (0 failed); LoadGen: VALID
    server performance: 1.96 queries/s at target 2.00; latency p50 0.412 s, p99 0.903 s; \
TTFT p50 0.101 s, p99 0.388 s (SUT clock); LoadGen: VALID
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from vlm_catalog.engine.arguments import add_device_arguments, device_options
from vlm_catalog.paths import DEFAULT_MODEL_DIR


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", description=(
            "Run MLPerf LoadGen over a catalogue. Defaults are the benchmark's settings "
            "(LoadGen's mlperf.conf for qwen3-vl-235b-a22b: at least 600 s, and 48,289 queries in Offline); "
            "--count and --duration shorten a run."
        ),
    )
    parser.add_argument("--scenario", required=True, choices=("offline", "server"))
    parser.add_argument("--mode", required=True, choices=("accuracy", "performance"))
    parser.add_argument("--dataset", type=Path, required=True, help="catalogue to read")
    parser.add_argument("--split", default=None, help='splits to use, e.g. "test" or "train+test"')
    parser.add_argument("--out-dir", type=Path, required=True, help="folder for LoadGen's logs and accuracy.txt")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR,
                        help="checkpoint directory (the engine's; with --server-url, the served one's "
                             "generation_config.json gives the mlperf style's sampling)")
    parser.add_argument("--count", type=int, default=None,
                        help="samples to use and minimum query count (drops the 600 s minimum unless --duration)")
    parser.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                        help="minimum duration (drops the minimum query count unless --count)")
    parser.add_argument("--target-qps", type=float, default=None,
                        help="Server: Poisson arrival rate; Offline: expected samples/s (sizes a --duration run)")
    parser.add_argument("--request-style", default="mlperf", choices=("mlperf", "ours"),
                        help="mlperf: the reference's requests (re-encoded image, no guided decoding, "
                             "checkpoint sampling); ours: per-record constrained schema, greedy")
    parser.add_argument("--max-tokens", type=int, default=150, help="answer cap (the submitters' 150)")
    parser.add_argument("--server-url", default=None, help="a running `vlm-catalog serve`, e.g. http://127.0.0.1:8000")
    parser.add_argument("--server-model", default=None, help="model name to request (default: the first the server lists)")
    parser.add_argument("--api-key", default=None,
                        help="with --server-url: the key of a `serve --api-key` server (default: $VLM_CATALOG_API_KEY)")
    parser.add_argument("--max-in-flight", type=int, default=512,
                        help="with --server-url: requests sent at once (the rest wait in the client)")
    parser.add_argument("--request-timeout", type=float, default=3600.0, metavar="SECONDS",
                        help="with --server-url: how long a request may wait for the server (a stream: between "
                             "two chunks) before its sample fails")
    parser.add_argument("--token-latencies", action="store_true",
                        help="Server: LoadGen measures TTFT/TPOT and judges the run on them (limits = 12 s)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--no-prefix-caching", action="store_true", help="as the benchmark's rules require")
    parser.add_argument("--policy", default="fcfs", choices=("fcfs", "shortest_prompt_first"))
    add_device_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from vlm_catalog.signals import signals_raise_keyboard_interrupt

    with signals_raise_keyboard_interrupt():  # SIGTERM ends a run as Ctrl-C does (130, one line)
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from vlm_catalog.bench.loadgen.harness import (
        BenchConfig,
        BenchError,
        Interrupted,
        run_benchmark,
    )
    from vlm_catalog.bench.loadgen.report import FAILURES_FILE, SummaryError
    from vlm_catalog.bench.loadgen.responses import PRINTED_ERRORS
    from vlm_catalog.bench.loadgen.settings import RunOptions, SettingsError
    from vlm_catalog.data.format import CatalogueError
    from vlm_catalog.engine.config import EngineConfigError
    from vlm_catalog.model.config import ModelConfigError
    from vlm_catalog.model.loader import CheckpointError

    try:
        options = RunOptions(
            scenario=args.scenario, mode=args.mode, count=args.count, duration_s=args.duration,
            target_qps=args.target_qps, token_latencies=args.token_latencies,
        )
        config = BenchConfig(
            options=options, dataset=args.dataset, out_dir=args.out_dir, model=args.model, split=args.split,
            request_style=args.request_style, max_tokens=args.max_tokens, server_url=args.server_url,
            server_model=args.server_model, server_api_key=args.api_key or os.environ.get("VLM_CATALOG_API_KEY"),
            max_in_flight=args.max_in_flight, request_timeout_s=args.request_timeout, device=args.device,
            dtype=args.dtype,
            enable_prefix_caching=not args.no_prefix_caching, scheduling_policy=args.policy,
            **device_options(args),
        )
        result = run_benchmark(config)
    except (SettingsError, BenchError, CatalogueError, CheckpointError, ModelConfigError, EngineConfigError,
            SummaryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Interrupted:  # LoadGen's C++ run cannot be stopped: end the process now
        print(f"error: interrupted; the LoadGen logs in {args.out_dir} are incomplete", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    if result.accuracy is not None:
        print(result.accuracy.format_table())
        print(f"wrote {args.out_dir / 'accuracy.txt'} (category hF1 {result.accuracy.category_hf1:.4f})")
    print(format_result(result, args.scenario, args.mode))
    tally = result.tally
    for error in tally.errors[:PRINTED_ERRORS]:  # the first few; each failed sample was answered with ""
        print(f"failed: {error}", file=sys.stderr)
    if len(tally.errors) > PRINTED_ERRORS:
        print(f"failed: ... and {len(tally.errors) - PRINTED_ERRORS} more, in {args.out_dir / FAILURES_FILE}",
              file=sys.stderr)
    if tally.failed and args.token_latencies:
        print(f"warning: LoadGen's TTFT and TPOT count the {tally.failed} failed samples as empty answers, "
              "so its token latencies do not describe this run", file=sys.stderr)
    print(f"LoadGen logs in {args.out_dir}")
    if tally.samples and tally.failed == tally.samples:  # LoadGen's verdict is about timing; nothing was answered
        print(f"error: every one of the {tally.samples} samples failed (reasons above)", file=sys.stderr)
        return 1
    if tally.failed and args.mode == "performance":  # a failed sample completes at once, as an empty answer
        print(f"error: {tally.failed} of {tally.samples} samples failed (reasons above; all in "
              f"{args.out_dir / FAILURES_FILE}): LoadGen counted them as answered, so this is not a result",
              file=sys.stderr)
        return 1
    return 0


def format_result(result, scenario: str, mode: str) -> str:
    """The one-line result: throughput, latencies (Server), failures and LoadGen's verdict."""
    summary, tally = result.summary, result.tally
    failed = f"({tally.failed} failed)"
    if summary is None:  # accuracy mode: LoadGen measures nothing, the SUT's clock does
        seconds = tally.active_seconds
        rate = tally.samples / seconds if seconds > 0 else 0.0
        unit = "samples/s" if scenario == "offline" else "queries/s"
        return (
            f"{scenario} {mode}: {tally.samples} samples in {seconds:.2f} s ({rate:.2f} {unit}, SUT clock) "
            f"{failed}; LoadGen: no performance verdict in accuracy mode"
        )
    verdict = "VALID" if summary.valid else f"INVALID ({_unmet(summary)})"
    throughput = summary.samples_per_second or 0.0
    if scenario == "offline":
        busy = ""
        if tally.engine_busy_s and throughput:  # in-process: engine time over LoadGen's duration
            busy = f"; engine busy {tally.engine_busy_s / (tally.samples / throughput):.1%} of the run"
        return (
            f"offline {mode}: {throughput:.2f} samples/s over {tally.samples} samples "
            f"{failed}{busy}; LoadGen: {verdict}"
        )
    latency = summary.latency_percentiles_ns
    parts = [f"server {mode}: {throughput:.2f} queries/s at target {result.target_qps:.2f}"]
    if 50.0 in latency and 99.0 in latency:
        parts.append(f"latency p50 {latency[50.0] / 1e9:.3f} s, p99 {latency[99.0] / 1e9:.3f} s")
    first = summary.first_token_percentiles_ns
    if 50.0 in first and 99.0 in first:
        parts.append(f"TTFT p50 {first[50.0] / 1e9:.3f} s, p99 {first[99.0] / 1e9:.3f} s (LoadGen)")
    elif tally.ttft_s:
        p50, p99 = _percentile(tally.ttft_s, 0.50), _percentile(tally.ttft_s, 0.99)
        parts.append(f"TTFT p50 {p50:.3f} s, p99 {p99:.3f} s (SUT clock)")
    return "; ".join(parts) + f" {failed}; LoadGen: {verdict}"


def _unmet(summary) -> str:
    """LoadGen's unmet conditions, e.g. "early stopping not satisfied"."""
    unmet = [
        key.lower() for key, value in summary.fields.items()
        if key.endswith("satisfied") and value.upper() == "NO"
    ]
    return ", ".join(f"{key.removesuffix(' satisfied')} not satisfied" for key in unmet) or "see the summary log"


def _percentile(values: list[float], fraction: float) -> float:
    """The value at rank floor(n * fraction) of the sorted values, as LoadGen ranks them."""
    ordered = sorted(values)
    return ordered[min(int(len(ordered) * fraction), len(ordered) - 1)]
