"""scripts/bench_kernels.py: a clear no-op without a GPU, a working --interpret smoke run, and
bench_gpu.py's kernels phase (which loads bench_kernels.py as a module).

The subprocesses hide any GPU (CUDA_VISIBLE_DEVICES="") and name the interpreter
explicitly, so they behave the same on a GPU machine as on a CPU-only one."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "bench_kernels.py"


def cpu_only_env(interpret: bool) -> dict[str, str]:
    """This process's environment with no GPU visible and the interpreter set or unset."""
    env = {key: value for key, value in os.environ.items() if key not in ("VLM_CATALOG_KERNELS", "TRITON_INTERPRET")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return env


def run_script(*args: str, script: Path = SCRIPT, interpret: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=REPO_ROOT,
        env=cpu_only_env(interpret),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_without_a_gpu_it_says_so_and_exits_0():
    result = run_script()
    assert result.returncode == 0, result.stderr
    assert "no CUDA GPU" in result.stdout


def test_interpret_smoke_run_writes_json(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "bench.json"
    result = run_script("--interpret", "--json", str(out), interpret=True)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    names = {row["name"] for row in report["rows"]}
    assert {
        "fused_moe",
        "paged_decode_attention",
        "paged_prefill_attention",
        "varlen_attention",
    } <= names
    assert all(row["triton_ms"] > 0 and row["baseline_ms"] > 0 for row in report["rows"])


def test_bench_gpu_loads_bench_kernels_as_a_registered_module():
    """bench_gpu.py once exec'd bench_kernels.py without a sys.modules entry: its
    @dataclass then failed (dataclasses look the defining module up there)."""
    spec = importlib.util.spec_from_file_location("bench_gpu_under_test", REPO_ROOT / "scripts" / "bench_gpu.py")
    bench_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_gpu)
    sys.modules.pop("bench_kernels", None)
    try:
        module = bench_gpu.load_bench_kernels()
        assert sys.modules["bench_kernels"] is module
        assert bench_gpu.load_bench_kernels() is module  # loaded once
        row = module.Row("op", "T=1", 2.0, "torch", 4.0, "1 GB/s", target_speedup=1.5)
        assert row.speedup == 2.0 and row.meets_target
        assert module.TINY_SHAPES.hidden < module.GPU_SHAPES.hidden
    finally:
        sys.modules.pop("bench_kernels", None)


def test_bench_gpu_kernels_phase_runs_on_cpu(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "bench_gpu.json"
    result = run_script("--tiny", "--device", "cpu", "--phases", "kernels", "--json", str(out),
                        script=REPO_ROOT / "scripts" / "bench_gpu.py")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())["kernels"]
    assert report["device"] == "cpu (Triton interpreter)"
    assert {"fused_moe", "paged_decode_attention", "varlen_attention"} <= {row["name"] for row in report["rows"]}
