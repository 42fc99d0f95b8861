#!/usr/bin/env python
"""One prepared device call: issue 9's GPU checks in priority order, inside a time budget.

A session that is lent a GPU gets 15 minutes of device time in all, the machine's start
(a minute or more) included, and at most 10 minutes per call. This script is that call:

    python3 scripts/gpu_session.py --wheels .whl --out $OUT                # the `record` plan
    python3 scripts/gpu_session.py --plan tune --out $OUT                  # tune, then the engine with it
    python3 scripts/gpu_session.py --plan record --dry-run                 # print the plan, run nothing
    python3 scripts/gpu_session.py --steps kernels,vision_encoder --budget 200 --out $OUT  # a second call

(device call: `carry: [".whl"]`, `timeout_s` a little over `--budget`). It installs the
carried wheels (`../shared/tools/gpu-wheels`) into /tmp/site first, then runs each step of
the plan as a subprocess with its own time limit, never past the budget: a step that cannot
get its minimum is skipped, one that runs over is stopped (SIGINT to its process group, so
pytest still prints its summary of what ran; then SIGTERM and SIGKILL) and the next one
starts. Every step's output goes to `$OUT/session.log`; `$OUT/session.json` says for each
step its status (ok, failed, timeout, skipped), exit code and seconds. The steps write their
own results into `$OUT`. A device call brings back at most 8 files: where the steps run
would write more (the `decode` plan's 14), each step's files that no later step writes
again are moved into `$OUT/results.tar` once it ends (`tar xf results.tar` gives them back):

- `record`: `pytest -m gpu` (its slowest tests and summary in pytest_gpu.txt; on four
  workers where pytest-xdist is carried, each test limited where pytest-timeout is), then
  bench_gpu.py's phases into bench_gpu.json: engine_w8a8_channel timed twice, the ceilings
  and roofline, the profiled run (engine_profile), the same engine with 32k-token steps and
  with fast FP8 accumulation (engine_steps_32k.json, engine_fast.json), constrained decoding
  as served, the vision encoder; with time left the engine without async scheduling
  (engine_sync.json) and the kernel rows, as far as the budget goes.
- `decode`: the attention rows (the FP8 cache in both page layouts among them), the record
  engine on head-major pages (engine_head_major.json), the attention rows with bf16 dots, the vision encoder with
  cuDNN's attention first, the MoE rows, engine_w8a8_channel_fast, the same engine without
  async scheduling and with 32k-token steps (engine_*.json), the attention rows with V read
  as bytes (each into its own JSON), then the FP8 decode attention's launch settings tuned;
  `--steps` picks among them.
- `tune`: the record engine's W8A8 MoE tiles and FP8 decode attention launch settings
  tuned, each bucket's best written into `tuned_configs.json` as it is known
  (`kernels/tuned_configs.py`), then engine_w8a8_channel as served and with that table
  (engine_tuned.json); with time left, the bf16 decode buckets and the per-channel tiles
  under fast accumulation.
- `smoke`: two engine phases on CPU at the default model's shapes, to try the runner here.

A GPU test of faster code that can be switched off (`@pytest.mark.fast_path(name)`: the decode
kernel's in-place merge, the norm-and-router launch, `skinny_linear`, ...) that fails in the
`pytest_gpu` step leaves its name in a file (tests/conftest.py), and every later step runs with
that name added to `VLM_CATALOG_KERNELS_OFF`: the record then measures the code that passed, and
says so (`kernels_off` in session.json and in bench_gpu.py's JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SITE_DIR = Path("/tmp/site")  # where the carried wheels are installed (../shared/docs/GPU.md)
# a step stopped at its limit: SIGINT first (pytest then prints its summary of the tests that
# ran, Python code its traceback), SIGTERM after the first grace, SIGKILL after the second
STOP_SIGNALS = ((signal.SIGINT, 15.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, None))
PYTEST_SUMMARY_LINES = 100  # the tail of pytest's output kept as pytest_gpu.txt (durations, summary)
FILES_BACK = 8  # the most files a device call brings back from $OUT
SESSION_FILES = ("session.json", "session.log")
RESULTS_TAR = "results.tar"  # the steps' files, where they would be more than FILES_BACK
KERNELS_OFF_ENV_VAR = "VLM_CATALOG_KERNELS_OFF"  # kernels.dispatch (this script imports no project code)
FAILED_FAST_PATHS_ENV_VAR = "VLM_CATALOG_FAILED_FAST_PATHS"  # tests/conftest.py


@dataclass(frozen=True)
class Step:
    """One command of a plan. `max_s`: its own limit; `min_s`: skipped when less is left;
    `{out}` in `argv` is the output folder, and a leading "python3" is this script's own
    interpreter; `tail_to`: the last `tail_lines` lines of its
    output are also written to this file in the output folder; `optional`: (module, options)
    pairs, each option list appended only where its module is importable in the steps'
    environment (pytest plugins carried in .whl; without one the step still runs); `env`:
    (name, value) pairs set for this step alone."""

    name: str
    argv: tuple[str, ...]
    max_s: float
    min_s: float
    tail_to: str | None = None
    tail_lines: int = PYTEST_SUMMARY_LINES
    optional: tuple[tuple[str, tuple[str, ...]], ...] = ()
    env: tuple[tuple[str, str], ...] = ()


@dataclass
class StepResult:
    name: str
    status: str  # ok | failed | timeout | skipped
    seconds: float = 0.0
    returncode: int | None = None
    limit_s: float = 0.0
    command: list[str] = field(default_factory=list)
    kernels_off: list[str] = field(default_factory=list)  # VLM_CATALOG_KERNELS_OFF as the step ran


def bench_gpu(phases: str, *extra: str) -> tuple[str, ...]:
    return ("python3", "scripts/bench_gpu.py", "--phases", phases, "--json", "{out}/bench_gpu.json", *extra)


def bench_kernels(*args: str) -> tuple[str, ...]:
    return ("python3", "scripts/bench_kernels.py", *args)


# pytest -m gpu on four workers sharing the GPU, so the tests' Triton compilations use more of
# the host's 16 cores (100 tests now; 55 took 226 s in one process on 2026-11-25). Tests that
# size memory from the free device memory share a group (`xdist_group("gpu_memory")`: one at a
# time). A test that hangs fails alone and its worker is replaced.
PYTEST_GPU_OPTIONAL = (
    ("xdist", ("-n", "4", "--dist", "loadgroup")),
    ("pytest_timeout", ("--timeout", "200", "--timeout-method", "thread")),
)

CPU_SMOKE = ("--tiny", "--device", "cpu", "--records", "2", "--output-tokens", "4", "--image-size", "small")

# Times from the H100 run of 2026-11-27 (docs/results/gpu/gpu_session_2026-11-27.json): pytest -m
# gpu 136 s on four workers; engine_w8a8 95 s and engine_w8a8_channel 60 s as phases, about 25 s
# more per bench_gpu process (the catalogue, the random model), so the two did not fit in 170 s;
# the kernels step 71 s, constrained 128 s, vision_encoder 34 s. The steps' maxima add up to
# more than a call: the later ones get what is left, so the order is the priority.
PLANS: dict[str, tuple[Step, ...]] = {
    "record": (
        # correctness first: the numbers after it mean little if a kernel is wrong (118 tests took
        # 155 s on 2026-11-28; 144 now, about 200 s at that rate, and a test cut off by the step's
        # end counts for nothing)
        Step("pytest_gpu", ("python3", "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "--durations=30"),
             max_s=260, min_s=120, tail_to="pytest_gpu.txt", optional=PYTEST_GPU_OPTIONAL),
        # the per-channel W8A8 engine as served: FlashAttention 3 for the vision tower and whole
        # prompts where the fa3-fwd wheel was carried, the GPU model's tuned table where one is
        # packaged, async scheduling (the default on CUDA since the H100 run of 2026-11-28: 18.04
        # samples/s against 17.58 without). Timed twice (--repeat-runs 2): the first timed run of a
        # process has been the slower every time (15.04 in a process that found Triton's cache
        # empty), and each run now records the Triton variants it launched first, its collections
        # and the allocator's calls (`diagnostics`): what the second run did not pay for
        Step("engines", bench_gpu("engine_w8a8_channel", "--repeat-runs", "2"), max_s=200, min_s=110),
        # the decode step's kernels at batch 1 and 256 (the 1.5x target), with and without the
        # newest decode fusions (decode_batch1_unfused)
        Step("roofline", bench_gpu("ceilings,roofline"), max_s=70, min_s=40),
        # constrained decoding as served (the per-channel W8A8 model with an FP8 cache, async
        # scheduling now, every record at once): constrained, unconstrained, then constrained again
        # (--repeat-runs 2): 0.91x, then 0.95x on 2026-11-28; before the profile and the candidate
        # engines, since it measures a target (about 130 s: four runs, the last with jump-forward
        # the other way, so it starts only with that; a phase cut off records nothing); after the
        # profile there would be about 100 s left, too few
        Step("constrained", bench_gpu("constrained_w8a8_channel", "--repeat-runs", "2"), max_s=170, min_s=130),
        # where the device time goes with routing spread as a trained model's (2026-11-28's profile
        # had collapsed routing), and where inside each region the device waited for the host
        # (`idle_seconds`, `waits`: the 0.87 s of "rest of steps" against 0.09 s of kernels there)
        Step("engine_profile", bench_gpu("engine_profile"), max_s=120, min_s=70),
        # the vision tower's MFU (a target met twice; about 30 s)
        Step("vision_encoder", bench_gpu("vision_encoder"), max_s=60, min_s=30),
        # the same engine with 32k-token steps: half the prefill steps, twice the rows per expert in
        # the MoE GEMMs (the largest cost of a run: 483 TFLOP/s at 16k tokens)
        Step("engine_steps_32k", ("python3", "scripts/bench_gpu.py", "--phases", "engine_w8a8_channel",
                                  "--max-num-batched-tokens", "32768", "--json", "{out}/engine_steps_32k.json"),
             max_s=130, min_s=75),
        # the FP8 GEMMs summing whole K loops in the tensor core (VLM_CATALOG_FP8_FAST_ACCUMULATION=1,
        # vLLM's choice): the MoE at 16k tokens 2.07 ms against 2.56 on 2026-11-28; what the engine
        # would gain for those bits
        Step("engine_fast", ("python3", "scripts/bench_gpu.py", "--phases", "engine_w8a8_channel_fast", "--json",
                             "{out}/engine_fast.json"), max_s=130, min_s=100),  # a cold compile of its FP8 variants
        # with time left: the engine reading each step's tokens first (the comparison behind the
        # async default), and the kernel rows (the new kernels' rows: add_rms_norm_route[one launch],
        # skinny_linear[...])
        Step("engine_sync", ("python3", "scripts/bench_gpu.py", "--phases", "engine_w8a8_channel",
                             "--async-scheduling", "off", "--json", "{out}/engine_sync.json"), max_s=130, min_s=60),
        Step("kernels", bench_gpu("kernels"), max_s=110, min_s=60),
    ),
    # tune, then measure what the tuning gives, in one call: every tuner writes each bucket's best
    # into {out}/tuned_configs.json as soon as it is known (kernels/tuned_configs.py; a GPU model
    # with a packaged table starts from it), and the engine then runs as served and with that
    # table, in one process on the same records. The table comes back with the call; committed as
    # kernels/tuned/<GPU model>.json it is the default on that GPU model.
    "tune": (
        # the record engine's expert tiles (per-channel W8A8 summing into float32 every K step
        # takes the block-scaled W8A8 entries): its decode steps at batch 256 first (150 of them a
        # run; 0.257 ms per layer tuned on the H100 of 2026-11-27, evening: 2.35 TB/s of 0.6 GB),
        # then its 16k-token prefill steps, then the smaller decode batches of a run's tail
        Step("tune_moe_w8a8", bench_kernels("--tune-moe", "--fp8", "--w8a8", "--buckets", "256", "16384", "128", "1",
                                            "--write-table", "{out}/tuned_configs.json"),
             max_s=200, min_s=60, tail_to="tune_moe_w8a8.txt", tail_lines=200),
        # the FP8-cache decode attention at the decode batches a run goes through
        Step("tune_decode_fp8", bench_kernels("--tune-decode", "--fp8", "--buckets", "256", "128", "32", "1",
                                              "--write-table", "{out}/tuned_configs.json"),
             max_s=100, min_s=40, tail_to="tune_decode_fp8.txt", tail_lines=200),
        Step("engine_tuned", ("python3", "scripts/bench_gpu.py", "--phases",
                              "engine_w8a8_channel,engine_w8a8_channel_tuned", "--tuned-configs",
                              "{out}/tuned_configs.json", "--json", "{out}/engine_tuned.json"),
             max_s=260, min_s=150),
        # with time left: the bf16-cache decode attention (the kernel rows' comparison with SDPA is
        # on a bf16 cache; 0.86-0.99x on the H200), the bf16 MoE's decode buckets (the roofline's
        # batch-1 step), and per-channel W8A8 under fast accumulation, whose tiles are its own
        Step("tune_decode_bf16", bench_kernels("--tune-decode", "--buckets", "1", "32", "128", "256",
                                               "--write-table", "{out}/tuned_configs.json"),
             max_s=100, min_s=40),  # its lines are in session.log: a call brings back 8 files at most
        Step("tune_moe_bf16_decode", bench_kernels("--tune-moe", "--buckets", "1", "16", "64", "256",
                                                   "--write-table", "{out}/tuned_configs.json"),
             max_s=150, min_s=60, tail_to="tune_moe_bf16_decode.txt", tail_lines=200),
        Step("tune_moe_w8a8_channel", bench_kernels("--tune-moe", "--fp8", "--w8a8", "--per-channel",
                                                    "--buckets", "4096", "16384", "256", "1",
                                                    "--write-table", "{out}/tuned_configs.json"),
             max_s=200, min_s=60, tail_to="tune_moe_w8a8_channel.txt", tail_lines=200,
             env=(("VLM_CATALOG_FP8_FAST_ACCUMULATION", "1"),)),
    ),
    # the FP8-cache decode attention, slower on 2026-11-27 than on 2026-11-25 (docs/benchmarks.md):
    # the attention rows as they are, with V read as bytes, and with bf16 dots (the old loop), then
    # the FP8 decode's launch settings tuned
    "decode": (
        # in priority order: the attention rows (FlashAttention 3's among them), the vision tower
        # with FlashAttention 2; the FP8-cache attention as on 2026-11-25 (bf16 dots),
        # now both timed in CUDA graphs; the vision tower with cuDNN's attention; the per-channel
        # engine with fast accumulation (13.24 samples/s on 2026-11-27, against the record's
        # precise engine_w8a8_channel); V read as bytes; then the FP8 decode's launch settings tuned
        Step("attention", bench_kernels("--groups", "attention", "--json", "{out}/attention.json"),
             max_s=90, min_s=30, tail_to="attention.txt", tail_lines=60),
        # the record engine on paged caches laid out head-major (VLM_CATALOG_KV_LAYOUT, kernels/kv_cache.py):
        # worth its call where the attention rows' `[fp8 kv, head-major pages]` beat `[fp8 kv]`
        Step("engine_head_major", ("python3", "scripts/bench_gpu.py", "--phases", "engine_w8a8_channel", "--json",
                                   "{out}/engine_head_major.json"),
             max_s=130, min_s=100, env=(("VLM_CATALOG_KV_LAYOUT", "head_major"),)),
        # FlashAttention 3 is the default where the fa3-fwd wheel was carried (kernels/flash_varlen.py):
        # the attention rows above have its [fa3] rows; then the vision tower with torch's
        # FlashAttention 2 instead, against the record's vision_encoder (the record plan's engines
        # step compares the engines: engine_w8a8_channel_fa2)
        Step("vision_encoder_fa2", ("python3", "scripts/bench_gpu.py", "--phases", "vision_encoder", "--json",
                                    "{out}/vision_fa2.json"),
             max_s=60, min_s=30, env=(("VLM_CATALOG_FLASH_VARLEN", "torch"),)),
        Step("attention_bf16_dots", bench_kernels("--groups", "attention", "--json",
                                                  "{out}/attention_bf16_dots.json"),
             max_s=90, min_s=30, env=(("VLM_CATALOG_KERNELS_OFF", "fp8_float16_dots"),)),
        # the vision tower with cuDNN's attention first for its long images, against the record's
        # vision_encoder (the kernels phase's varlen_attention[sdpa, cudnn] rows time the calls alone)
        Step("vision_encoder_cudnn", ("python3", "scripts/bench_gpu.py", "--phases", "vision_encoder", "--json",
                                      "{out}/vision_cudnn.json"),
             max_s=60, min_s=30, env=(("VLM_CATALOG_SDPA_BACKEND", "cudnn"),)),
        # the MoE rows: the grouped GEMMs against the Triton kernels at 256 to 16384 tokens
        Step("moe_rows", bench_kernels("--groups", "moe", "--json", "{out}/moe.json"), max_s=90, min_s=40),
        Step("engine_fast", ("python3", "scripts/bench_gpu.py", "--phases", "engine_w8a8_channel_fast", "--json",
                             "{out}/engine_fast.json"), max_s=130, min_s=100),
        # the default engine reading each step's tokens before it schedules the next (async
        # scheduling is the default on CUDA), then with 32k-token steps
        Step("engine_sync", ("python3", "scripts/bench_gpu.py", "--phases", "engine_w8a8_channel",
                             "--async-scheduling", "off", "--json", "{out}/engine_sync.json"), max_s=130, min_s=100),
        Step("engine_steps_32k", ("python3", "scripts/bench_gpu.py", "--phases", "engine_w8a8_channel",
                                  "--max-num-batched-tokens", "32768", "--json", "{out}/engine_steps_32k.json"),
             max_s=130, min_s=100),
        Step("attention_v_bytes", bench_kernels("--groups", "attention", "--json", "{out}/attention_v_bytes.json"),
             max_s=90, min_s=30, env=(("VLM_CATALOG_KERNELS_OFF", "fp8_v_words"),)),
        Step("tune_decode_fp8", bench_kernels("--tune-decode", "--fp8", "--write-table", "{out}/tuned_configs.json"),
             max_s=200, min_s=60, tail_to="tune_decode_fp8.txt", tail_lines=200),
        # the vision tower with every image on our Triton kernel (one masked 128-column tile), against
        # the record's vision_encoder; the attention rows above time its tile candidates alone
        Step("vision_encoder_triton", ("python3", "scripts/bench_gpu.py", "--phases", "vision_encoder", "--json",
                                       "{out}/vision_triton.json"),
             max_s=60, min_s=30, env=(("VLM_CATALOG_VARLEN_ATTENTION", "triton"),)),
        # the default engine with every Triton kernel launched with programmatic dependent launch
        # (kernels/pdl.py; the roofline phase times the batch-1 decode step both ways)
        Step("engine_pdl", ("python3", "scripts/bench_gpu.py", "--phases", "engine_w8a8_channel", "--json",
                            "{out}/engine_pdl.json"), max_s=130, min_s=100, env=(("VLM_CATALOG_PDL", "1"),)),
    ),
    # on CPU with the default model's shapes: the runner and the JSON merge, end to end (a test)
    "smoke": (
        Step("engine", bench_gpu("engine", *CPU_SMOKE), max_s=120, min_s=10),
        Step("engine_fp8", bench_gpu("engine_fp8", *CPU_SMOKE), max_s=120, min_s=10),
    ),
}


class WheelInstallError(RuntimeError):
    """The carried wheels could not be installed; the message says why."""


def install_wheels(wheels: Path, log) -> dict[str, str]:
    """pip-install the carried wheels into SITE_DIR; the environment the steps then run in."""
    found = sorted(str(path) for path in wheels.glob("*.whl"))
    if not found:
        raise WheelInstallError(f"{wheels} holds no wheels (run ../shared/tools/gpu-wheels and carry .whl)")
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", str(SITE_DIR), *found]
    if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False).returncode:
        raise WheelInstallError(f"pip could not install the wheels in {wheels} (its output is in session.log)")
    return {"PYTHONPATH": os.pathsep.join([str(SITE_DIR), str(REPO_ROOT)])}


def step_files(step: Step) -> set[str]:
    """The files a step writes into the output folder: its tail and the `{out}/...` of its command."""
    named = {part.removeprefix("{out}/") for part in step.argv if part.startswith("{out}/")}
    return named | ({step.tail_to} if step.tail_to else set())


def written_files(steps: tuple[Step, ...] | list[Step]) -> set[str]:
    """Every file `steps` leave in the output folder, the session's own two included."""
    return set(SESSION_FILES).union(*(step_files(step) for step in steps))


def packs_results(steps: tuple[Step, ...] | list[Step]) -> bool:
    """Whether `steps` would leave more files than a device call brings back."""
    return len(written_files(steps)) > FILES_BACK


def pack_finished_files(out: Path, still_written: set[str]) -> list[str]:
    """Move the files in `out` that no later step writes (`still_written`: the later steps' files)
    into `out/RESULTS_TAR`, appended, and return their names. A file a later step rewrites or
    merges into stays in place until then."""
    import tarfile

    done = sorted(path.name for path in out.iterdir()
                  if path.is_file() and path.name not in {*SESSION_FILES, RESULTS_TAR, *still_written})
    if done:
        with tarfile.open(out / RESULTS_TAR, "a") as archive:
            for name in done:
                archive.add(out / name, arcname=name)
        for name in done:
            (out / name).unlink()
    return done


def run_plan(steps: tuple[Step, ...] | list[Step], budget_s: float, out: Path,
             env: dict[str, str] | None = None, cwd: Path = REPO_ROOT) -> list[StepResult]:
    """Run `steps` in order within `budget_s` seconds from now; results are also written to
    `out/session.json` after every step (a call cut short keeps what finished). Where the steps
    would write more files than a device call brings back, each step's finished files go into
    `out/RESULTS_TAR` when it ends (`pack_finished_files`)."""
    out = out.resolve()  # the steps run in `cwd`
    pack = packs_results(steps)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget_s
    failed_paths = Path(tempfile.mkdtemp(prefix="gpu_session_")) / "failed_fast_paths.txt"  # not in `out`
    step_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {}), FAILED_FAST_PATHS_ENV_VAR: str(failed_paths)}
    results: list[StepResult] = []
    with open(out / "session.log", "a") as log:
        said: set[str] = set()
        for index, step in enumerate(steps):
            step_env[KERNELS_OFF_ENV_VAR] = turned_off(step_env.get(KERNELS_OFF_ENV_VAR, ""), failed_paths, log, said)
            own_env = dict(step.env)
            if KERNELS_OFF_ENV_VAR in own_env:  # a step's own choice replaces the session's, failed paths stay off
                own_env[KERNELS_OFF_ENV_VAR] = turned_off(own_env[KERNELS_OFF_ENV_VAR], failed_paths, log, said)
            command = [part.replace("{out}", str(out)) for part in step.argv]
            if command[0] == "python3":  # the interpreter running this script (a venv's, here)
                command[0] = sys.executable
            limit = min(step.max_s, deadline - time.monotonic())
            if limit < step.min_s:
                results.append(StepResult(step.name, "skipped", limit_s=max(limit, 0.0), command=command))
                print(f"[gpu_session] {step.name}: skipped ({max(limit, 0):.0f} s left, needs {step.min_s:.0f})",
                      flush=True)
            else:  # only a step that runs probes for its optional options' modules
                for module, options in step.optional:
                    if importable(module, step_env):
                        command += options
                    else:
                        log.write(f"[gpu_session] {step.name}: {module} is not importable, running without "
                                  f"{shlex.join(options)}\n")
                results.append(_run_step(step, command, limit, out, log, {**step_env, **own_env}, cwd))
            results[-1].kernels_off = names_in(own_env.get(KERNELS_OFF_ENV_VAR, step_env[KERNELS_OFF_ENV_VAR]))
            if pack:
                packed = pack_finished_files(out, written_files(steps[index + 1:]))
                if packed:
                    log.write(f"[gpu_session] {step.name}: {', '.join(packed)} moved into {RESULTS_TAR}\n")
            (out / "session.json").write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    return results


def names_in(kernels_off: str) -> list[str]:
    """The names a VLM_CATALOG_KERNELS_OFF value lists, in order, once each."""
    return list(dict.fromkeys(name.strip() for name in kernels_off.split(",") if name.strip()))


def turned_off(kernels_off: str, failed_paths: Path, log, said: set[str] | None = None) -> str:
    """`kernels_off` with the fast paths whose GPU tests failed so far added (`failed_paths`,
    "name<TAB>test" per line, written by tests/conftest.py), each said once (`said`) in the log
    and on the console, with the test that failed."""
    names = names_in(kernels_off)
    said = set() if said is None else said
    lines = failed_paths.read_text().splitlines() if failed_paths.exists() else []
    failed: dict[str, list[str]] = {}
    for fields in (line.split("\t") for line in lines if line.strip()):
        failed.setdefault(fields[0].strip(), fields[1:])  # the first test that failed it
    for name, test in failed.items():
        if name not in names:
            names.append(name)
        if name not in said:
            said.add(name)
            where = f" ({test[0]})" if test else ""
            message = (f"[gpu_session] {name} failed its GPU test{where}: the later steps run with "
                       f"{KERNELS_OFF_ENV_VAR} naming it\n")
            log.write(message)
            print(message.strip(), flush=True)
    return ",".join(names)


def importable(module: str, env: dict[str, str]) -> bool:
    """Whether the steps' interpreter, in `env` (the carried wheels on its path), finds `module`."""
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, check=False).returncode == 0


def _run_step(step: Step, command: list[str], limit: float, out: Path, log, env, cwd: Path) -> StepResult:
    header = f"\n===== {step.name} (limit {limit:.0f} s): {shlex.join(command)}\n"
    print(header.strip(), flush=True)
    log.write(header)
    log.flush()
    lines: list[str] = []
    started = time.monotonic()
    # its own process group, so a step stopped at its limit takes its children (compile workers) along;
    # SIGINT as in a terminal, so the first stop signal works where this session was started with it
    # ignored (a shell's background job: `nohup ... &`), as it would not otherwise (a step then ran on
    # for SIGINT's whole grace, without pytest's summary)
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True, preexec_fn=_default_sigint)
    stopped = threading.Event()

    def stop() -> None:
        stopped.set()
        _stop_group(process)

    timer = threading.Timer(limit, stop)  # the reads below block, so a silent step is stopped from here
    timer.start()
    try:
        for line in process.stdout:  # ends when the group has exited (or was stopped)
            log.write(line)
            log.flush()
            lines.append(line)
        process.wait()
    finally:
        timer.cancel()
    seconds = time.monotonic() - started
    if step.tail_to:
        (out / step.tail_to).write_text("".join(lines[-step.tail_lines:]))
    status = "timeout" if stopped.is_set() else ("ok" if process.returncode == 0 else "failed")
    print(f"[gpu_session] {step.name}: {status} in {seconds:.0f} s (exit {process.returncode})", flush=True)
    return StepResult(step.name, status, seconds, process.returncode, limit, command)


def _default_sigint() -> None:
    """In a step's child, before it starts: SIGINT's default action (a Python child then installs its
    KeyboardInterrupt handler), whatever this process inherited."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stop_group(process: subprocess.Popen) -> None:
    """Signal the step's process group through STOP_SIGNALS until all of it has exited (the
    leader may exit on SIGINT before its children: pytest-xdist's workers, compile workers)."""
    for sig, grace in STOP_SIGNALS:
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return  # the whole group is gone
        deadline = time.monotonic() + (grace or 0.0)
        while time.monotonic() < deadline:
            time.sleep(0.1)
            try:
                os.killpg(process.pid, 0)  # the leader counts until _run_step reaps it
            except ProcessLookupError:
                return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", choices=sorted(PLANS), default="record")
    parser.add_argument("--budget", type=float, default=560.0,
                        help="seconds for the whole plan, wheels included (default 560: a 600 s call "
                             "with room to spare)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "scratch/gpu_session")))
    parser.add_argument("--wheels", type=Path, help="a folder of wheels to install first (.whl from gpu-wheels)")
    parser.add_argument("--steps", help="comma-separated names of the plan's steps to run, in the plan's order "
                                            "(e.g. those a first call skipped: its session.json says which)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args = parser.parse_args(argv)
    if args.budget <= 0:
        parser.error(f"--budget must be positive, got {args.budget}")
    steps = PLANS[args.plan]
    if args.steps is not None:
        wanted = [name.strip() for name in args.steps.split(",") if name.strip()]
        unknown = [name for name in wanted if name not in {step.name for step in steps}]
        if unknown or not wanted:
            parser.error(f"--steps {args.steps!r}: {', '.join(unknown) or 'no step named'}; the {args.plan} plan's "
                         f"steps are {', '.join(step.name for step in steps)}")
        steps = tuple(step for step in steps if step.name in wanted)
    if args.dry_run:
        for step in steps:
            optional = "".join(f" [{shlex.join(options)} where {module} is importable]" for module, options in step.optional)
            variables = "".join(f" [with {name}={value}]" for name, value in step.env)
            print(f"{step.name}: {shlex.join(step.argv)}{optional}{variables}  (at most {step.max_s:.0f} s, "
                  f"skipped under {step.min_s:.0f} s)")
        return 0
    if args.wheels is not None and not args.wheels.is_dir():
        parser.error(f"--wheels {args.wheels} is not a folder (run ../shared/tools/gpu-wheels and carry .whl)")
    started = time.monotonic()
    env = {}
    if args.wheels is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "session.log", "a") as log:
            try:
                env = install_wheels(args.wheels, log)
            except WheelInstallError as exc:
                print(f"gpu_session: {exc}; no step ran", file=sys.stderr)
                return 1
    results = run_plan(steps, args.budget - (time.monotonic() - started), args.out, env)
    print(json.dumps([(r.name, r.status, round(r.seconds)) for r in results]))
    return 0 if all(r.status == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
