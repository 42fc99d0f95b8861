"""LoadGen TestSettings and LogSettings for a `vlm-catalog bench` run.

The defaults are the benchmark's: LoadGen's own `mlperf.conf` (built into the
`mlperf_loadgen` module) for the model `qwen3-vl-235b-a22b`, which sets
min_duration 600 s, min_query_count 48,289 (Offline), performance sample
count 48,289, the Server p99 latency bound of 12 s and the official RNG seeds.

`--count` and `--duration` shorten a run: when either is given, the run is
defined by them alone (the other bound is dropped, not left at the
benchmark's value): `count` becomes min_query_count and the number of samples
(the QSL's size and performance sample count), `duration` min_duration.
`--target-qps` is the Server scenario's Poisson rate, or the Offline
scenario's expected rate (which, with a duration, sizes the Offline query:
1.1 x rate x duration samples). `token_latencies` turns on LoadGen's
use_token_latencies (Server): LoadGen then reports TTFT and TPOT and judges
the run on them instead of the end-to-end p99 (the benchmark itself runs
without it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlperf_loadgen as lg

BENCHMARK_MODEL = "qwen3-vl-235b-a22b"
SCENARIOS = {"offline": lg.TestScenario.Offline, "server": lg.TestScenario.Server}
MODES = {"accuracy": lg.TestMode.AccuracyOnly, "performance": lg.TestMode.PerformanceOnly}
_MLPERF_CONF_ONLY = 0  # FromConfig's conf_type: read only the built-in mlperf.conf
# Bounds that keep LoadGen's up-front schedule allocatable (it holds every query before the run starts;
# --count 10^11 ended in std::bad_alloc and a segfault) and its uint64 fields whole (--duration inf).
MAX_QUERIES = 10_000_000
MAX_DURATION_S = 7 * 24 * 3600
MAX_TARGET_QPS = 1_000_000


class SettingsError(ValueError):
    """Bench options that make no sense; the message names the option."""


@dataclass(frozen=True)
class RunOptions:
    scenario: str  # "offline" | "server"
    mode: str  # "accuracy" | "performance"
    count: int | None = None  # samples / min query count
    duration_s: float | None = None  # min duration
    target_qps: float | None = None
    token_latencies: bool = False  # LoadGen's use_token_latencies (TTFT/TPOT constraints)

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS:
            raise SettingsError(f"--scenario must be one of {', '.join(SCENARIOS)}, got {self.scenario!r}")
        if self.mode not in MODES:
            raise SettingsError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.count is not None and not 1 <= self.count <= MAX_QUERIES:
            raise SettingsError(f"--count must be between 1 and {MAX_QUERIES:,}, got {self.count}")
        if self.duration_s is not None and not 0 < self.duration_s <= MAX_DURATION_S:  # NaN and inf fail too
            raise SettingsError(
                f"--duration must be a positive number of seconds, at most {MAX_DURATION_S:,} (a week), "
                f"got {self.duration_s}"
            )
        if self.target_qps is not None and not 0 < self.target_qps <= MAX_TARGET_QPS:
            raise SettingsError(f"--target-qps must be positive and at most {MAX_TARGET_QPS:,}, got {self.target_qps}")

    @property
    def shortened(self) -> bool:
        return self.count is not None or self.duration_s is not None


def benchmark_settings(scenario: str) -> lg.TestSettings:
    """The benchmark's TestSettings for a scenario, from LoadGen's built-in mlperf.conf."""
    settings = lg.TestSettings()
    status = settings.FromConfig("", BENCHMARK_MODEL, SCENARIOS[scenario].name, _MLPERF_CONF_ONLY)
    if status != 0:
        raise SettingsError(f"LoadGen's mlperf.conf has no settings for {BENCHMARK_MODEL} {scenario}")
    return settings


def build_test_settings(options: RunOptions, num_samples: int) -> lg.TestSettings:
    """TestSettings for a run over `num_samples` QSL samples (already limited by --count)."""
    settings = benchmark_settings(options.scenario)
    settings.scenario = SCENARIOS[options.scenario]
    settings.mode = MODES[options.mode]
    settings.performance_sample_count_override = min(settings.performance_sample_count_override, num_samples)
    if options.shortened:
        settings.min_query_count = options.count if options.count is not None else 1
        settings.min_duration_ms = round(options.duration_s * 1000) if options.duration_s is not None else 0
    if options.target_qps is not None:
        settings.server_target_qps = options.target_qps
        settings.offline_expected_qps = options.target_qps
    target = settings.server_target_qps if options.scenario == "server" else settings.offline_expected_qps
    queries = max(settings.min_query_count, target * settings.min_duration_ms / 1000)
    if queries > MAX_QUERIES:  # LoadGen schedules every query before the run: 10^11 of them crashed it
        raise SettingsError(
            f"this run would schedule about {queries:,.0f} queries ({target:g}/s for {settings.min_duration_ms / 1000:g} s); "
            f"at most {MAX_QUERIES:,}: lower --target-qps or --duration"
        )
    if options.token_latencies:
        # The benchmark sets no TTFT/TPOT limit: bound both by the end-to-end target.
        settings.use_token_latencies = True
        settings.ttft_latency = settings.server_target_latency_ns
        settings.tpot_latency = settings.server_target_latency_ns
    return settings


def build_log_settings(out_dir: Path) -> lg.LogSettings:
    """Write LoadGen's logs (summary, detail, accuracy) into `out_dir`; no trace, no stdout copy."""
    output = lg.LogOutputSettings()
    output.outdir = str(out_dir)
    output.prefix = "mlperf_log_"
    output.suffix = ""
    output.prefix_with_datetime = False
    output.copy_detail_to_stdout = False
    output.copy_summary_to_stdout = False
    settings = lg.LogSettings()
    settings.log_output = output
    settings.log_mode = lg.LoggingMode.AsyncPoll
    settings.enable_trace = False
    return settings
