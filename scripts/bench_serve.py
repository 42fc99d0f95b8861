#!/usr/bin/env python
"""The service's throughput and latency against the same records offline (`LLM.chat`).

For each record of the catalogue this builds the benchmark's request (the
mlperf prompt, decoding constrained by the per-record schema) and runs:

1. offline: all records in one `LLM.chat` call (after one warm-up pass, so
   grammars are compiled), timed end to end -> records/s; measured before and
   after the online runs (the machine's load drifts), the best run is the
   baseline;
2. online: `vlm-catalog serve` in a subprocess with the same engine settings,
   a warm-up pass, then at each concurrency level all records sent through
   `/v1/chat/completions` with `stream: true` (as an OpenAI client would), at
   most `concurrency` in flight -> requests/s, time to first token and
   end-to-end latency (p50/p99, client-side), and the ratio of the online
   requests/s to the offline records/s (best of --repeats runs per level);
3. paired: --pairs times, an offline run immediately followed by an online
   run at the highest concurrency; the median of the pairs' ratios is the
   figure least sensitive to other load on the machine.

CPU accounting: the offline run's CPU seconds per record (the bench process)
against the server process's CPU seconds per request ("CPU ratio" = offline
over server; the client's own CPU is shown apart). On a 2-core machine shared
with other work, wall-clock rates swing by tens of percent from run to run;
the CPU seconds a request costs are much steadier, and on an otherwise idle
CPU-bound machine the throughput ratio approaches the CPU ratio.

Prefix caching is off on both sides by default (the benchmark's rules, and
otherwise every level after the first would hit whole cached prompts); pass
--prefix-caching to turn it on for both. The client runs on the same machine
as the server and takes CPU from it; the ratio includes that cost.

    python scripts/bench_serve.py [--records 64] [--concurrency 1 4 16 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from schemas import ProductMetadata
from vlm_catalog.paths import DEFAULT_MODEL_DIR, SAMPLE_CATALOGUE_DIR


def build_requests(dataset: Path, count: int, max_tokens: int) -> list[dict]:
    """OpenAI chat bodies (without model/stream), one per record, and the candidates to check answers."""
    from vlm_catalog.data.loader import load_catalogue
    from vlm_catalog.preprocess.prompt import build_messages
    from vlm_catalog.structured import catalogue_schema

    catalogue = load_catalogue(dataset)
    records = [catalogue[i % len(catalogue)] for i in range(count)]
    return [
        {
            "messages": build_messages(record),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "product", "schema": catalogue_schema(record.candidate_categories).json_schema}},
            "candidates": list(record.candidate_categories),
        }
        for record in records
    ]


def valid(text: str, candidates: list[str]) -> bool:
    try:
        return ProductMetadata.model_validate_json(text).category in candidates
    except ValueError:
        return False


# ------------------------------------------------------------------- offline
class Offline:
    """`LLM.chat` over all records at once; warmed up once (grammars compiled)."""

    def __init__(self, args, requests: list[dict]) -> None:
        from vlm_catalog import LLM, SamplingParams

        self.requests = requests
        self.llm = LLM(args.model, device=args.device, enable_prefix_caching=args.prefix_caching)
        self.conversations = [request["messages"] for request in requests]
        self.params = [SamplingParams(max_tokens=request["max_tokens"], temperature=0.0,
                                      json_schema=request["response_format"]["json_schema"]["schema"])
                       for request in requests]
        self.llm.chat(self.conversations, self.params)

    def run(self) -> dict:
        started, cpu_started = time.perf_counter(), time.process_time()
        outputs = self.llm.chat(self.conversations, self.params)
        seconds = time.perf_counter() - started
        return {
            "seconds": seconds,
            "records_per_second": len(self.requests) / seconds,
            "cpu_seconds_per_record": (time.process_time() - cpu_started) / len(self.requests),
            "valid": sum(valid(output.text, request["candidates"]) for output, request in zip(outputs, self.requests)),
        }

    def close(self) -> None:
        self.llm.engine.close()


# -------------------------------------------------------------------- online
class ServerProcess:
    def __init__(self, args) -> None:
        command = [sys.executable, "-m", "vlm_catalog.cli", "serve", "--port", "0", "--model", str(args.model),
                   "--device", args.device, "--log-level", "warning"]
        if not args.prefix_caching:
            command.append("--no-prefix-caching")
        env = {name: value for name, value in os.environ.items() if name != "VLM_CATALOG_API_KEY"}
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.url = None
        ready = threading.Event()

        def read() -> None:
            for line in self.process.stdout:
                found = re.search(r"serving '(.*)' at (http://\S+)", line)
                if found:
                    self.model_name, self.url = found.group(1), found.group(2)
                    ready.set()
                elif "error" in line.lower() or "Traceback" in line:
                    print(f"[server] {line}", end="", file=sys.stderr)
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(300)
        if self.url is None:
            raise SystemExit("the server did not start")

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(60)


async def one_request(client: httpx.AsyncClient, model: str, request: dict) -> dict:
    body = {key: value for key, value in request.items() if key != "candidates"}
    body.update(model=model, stream=True)
    started = time.perf_counter()
    first_token = None
    pieces = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            content = event["choices"][0]["delta"].get("content") if event["choices"] else None
            if content:
                if first_token is None:
                    first_token = time.perf_counter() - started
                pieces.append(content)
    return {"ttft": first_token, "e2e": time.perf_counter() - started, "text": "".join(pieces)}


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_online(server: ServerProcess, requests: list[dict], concurrency: int) -> dict:
    """One pass at `concurrency`, with the CPU seconds the server and the client spent per request."""
    server_cpu, client_cpu = process_cpu_seconds(server.process.pid), time.process_time()
    level = asyncio.run(run_level(server.url, server.model_name, requests, concurrency))
    level["server_cpu_seconds_per_request"] = (process_cpu_seconds(server.process.pid) - server_cpu) / len(requests)
    level["client_cpu_seconds_per_request"] = (time.process_time() - client_cpu) / len(requests)
    return level


async def run_level(url: str, model: str, requests: list[dict], concurrency: int) -> dict:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def gated(request):
            async with gate:
                return await one_request(client, model, request)

        started = time.perf_counter()
        results = await asyncio.gather(*(gated(request) for request in requests))
        seconds = time.perf_counter() - started
    ttfts = [result["ttft"] for result in results if result["ttft"] is not None]
    e2es = [result["e2e"] for result in results]
    return {
        "concurrency": concurrency,
        "seconds": seconds,
        "requests_per_second": len(requests) / seconds,
        "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
        "e2e_p50": percentile(e2es, 50), "e2e_p99": percentile(e2es, 99),
        "valid": sum(valid(result["text"], request["candidates"]) for result, request in zip(results, requests)),
    }


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--dataset", type=Path, default=SAMPLE_CATALOGUE_DIR)
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=150)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prefix-caching", action="store_true", help="on for both sides (default off)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per measurement; the best is reported")
    parser.add_argument("--pairs", type=int, default=3,
                        help="offline/online run pairs at the highest concurrency for the paired ratio")
    parser.add_argument("--json", dest="json_out", type=Path)
    args = parser.parse_args(argv)

    requests = build_requests(args.dataset, args.records, args.max_tokens)
    print(f"{len(requests)} records, model {args.model.name}, device {args.device}, "
          f"prefix caching {'on' if args.prefix_caching else 'off'}, {os.cpu_count()} CPUs, "
          f"best of {args.repeats} runs")
    offline = Offline(args, requests)
    offline_runs = [offline.run() for _ in range(args.repeats)]  # more runs after the online ones (drift)
    server = ServerProcess(args)
    levels, pairs = [], []
    try:
        run_online(server, requests, max(args.concurrency))  # warm-up
        for concurrency in args.concurrency:
            runs = [run_online(server, requests, concurrency) for _ in range(args.repeats)]
            levels.append(max(runs, key=lambda run: run["requests_per_second"]))
        # paired runs at the highest concurrency, each right after an offline run: robust to load drift
        for _ in range(args.pairs):
            offline_run = offline.run()
            online_run = run_online(server, requests, max(args.concurrency))
            pairs.append({"offline": offline_run["records_per_second"], "online": online_run["requests_per_second"],
                          "ratio": online_run["requests_per_second"] / offline_run["records_per_second"]})
    finally:
        exit_code = server.stop()
    offline_runs += [offline.run() for _ in range(args.repeats)]
    offline.close()
    best = max(offline_runs, key=lambda run: run["records_per_second"])
    all_runs = ", ".join(f"{run['records_per_second']:.2f}" for run in offline_runs)
    print(f"offline LLM.chat: {best['records_per_second']:.2f} records/s best ({all_runs} over all runs), "
          f"{best['valid']}/{len(requests)} valid")
    offline_cpu = min(run["cpu_seconds_per_record"] for run in offline_runs)
    print(f"offline CPU: {1000 * offline_cpu:.1f} ms per record (least over all runs)")
    print(f"{'concurrency':>11} {'req/s':>7} {'ratio':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'e2e p50':>8} {'e2e p99':>8} {'valid':>6} {'server CPU/req':>15} {'CPU ratio':>9} {'client CPU/req':>15}")
    for level in levels:
        level["ratio_to_offline"] = level["requests_per_second"] / best["records_per_second"]
        level["cpu_ratio_to_offline"] = offline_cpu / level["server_cpu_seconds_per_request"]
        print(f"{level['concurrency']:>11} {level['requests_per_second']:>7.2f} {level['ratio_to_offline']:>6.2f} "
              f"{level['ttft_p50']:>8.3f}s {level['ttft_p99']:>8.3f}s {level['e2e_p50']:>7.3f}s "
              f"{level['e2e_p99']:>7.3f}s {level['valid']:>3}/{len(requests)} "
              f"{1000 * level['server_cpu_seconds_per_request']:>12.1f} ms {level['cpu_ratio_to_offline']:>9.2f} "
              f"{1000 * level['client_cpu_seconds_per_request']:>12.1f} ms")
    if pairs:
        ratios = sorted(pair["ratio"] for pair in pairs)
        print(f"paired at concurrency {max(args.concurrency)} (offline run, then online run) x{len(pairs)}: "
              f"ratios {', '.join(f'{ratio:.2f}' for ratio in ratios)}; median {statistics.median(ratios):.2f}")
    print(f"server stopped with exit code {exit_code}")
    if args.json_out:
        args.json_out.write_text(json.dumps({
            "machine": platform.platform(), "cpus": os.cpu_count(), "records": len(requests),
            "prefix_caching": args.prefix_caching, "offline_runs": offline_runs, "online": levels, "pairs": pairs,
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
