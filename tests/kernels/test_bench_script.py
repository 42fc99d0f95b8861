"""scripts/bench_kernels.py: a clear no-op without a GPU, and a working --interpret smoke run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "bench_kernels.py"


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "VLM_CATALOG_KERNELS"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_without_a_gpu_it_says_so_and_exits_0():
    result = run_script()
    assert result.returncode == 0, result.stderr
    assert "no CUDA GPU" in result.stdout


def test_interpret_smoke_run_writes_json(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "bench.json"
    result = run_script("--interpret", "--json", str(out))
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
