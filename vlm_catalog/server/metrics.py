"""Prometheus metrics of one app (its own registry, so several apps can live in a process).

Latency histograms and token/error counters are updated as requests finish;
the load gauges (running, waiting, KV usage, prefix-cache hit ratio, the
service's places held and its capacity) are read from the engine and the
gateway at scrape time by a collector, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

LOAD_GAUGES = {
    "requests_running": "Requests the engine is computing",
    "requests_waiting": "Requests queued in the engine, not yet admitted",
    "kv_cache_usage_ratio": "KV-cache blocks held by live requests over all blocks",
    "prefix_cache_hit_ratio": "Prompt blocks served by the prefix cache over all blocks looked up",
    "requests_in_service": "Requests holding a place in the service (read, prepared, in the engine or streaming out)",
    "service_capacity": "Places in the service (max_num_seqs + max_waiting_requests); past them requests get 429",
}


class _EngineLoadCollector(Collector):
    def __init__(self, load_stats: Callable[[], dict[str, float]]) -> None:
        self.load_stats = load_stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self.load_stats()
        for name, documentation in LOAD_GAUGES.items():
            yield GaugeMetricFamily(f"vlm_catalog_{name}", documentation, value=float(stats[name]))


class ServiceMetrics:
    def __init__(self, load_stats: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry()
        self.time_to_first_token = Histogram(
            "vlm_catalog_time_to_first_token_seconds", "Arrival to first generated token",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "vlm_catalog_e2e_request_latency_seconds", "Arrival to last token of finished requests",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.prompt_tokens = Counter("vlm_catalog_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=self.registry)
        self.generation_tokens = Counter("vlm_catalog_generation_tokens", "Generated tokens of finished requests",
                                         registry=self.registry)
        self.requests_finished = Counter("vlm_catalog_requests_finished", "Requests answered by the engine",
                                         ["finish_reason"], registry=self.registry)
        self.request_errors = Counter("vlm_catalog_request_errors", "Requests answered with an error, by kind",
                                      ["kind"], registry=self.registry)
        self.registry.register(_EngineLoadCollector(load_stats))

    def count_error(self, kind: str) -> None:
        self.request_errors.labels(kind=kind).inc()

    def observe_finished(self, prompt_tokens: int, generated_tokens: int, finish_reason: str,
                         ttft: float | None, e2e: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)
        self.requests_finished.labels(finish_reason=finish_reason).inc()
        if ttft is not None:
            self.time_to_first_token.observe(ttft)
        self.e2e_latency.observe(e2e)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
