"""scripts/bench_step_overhead.py on a small batch: the step splits into forward, logits and host."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_step_overhead_smoke(tmp_path):
    out = tmp_path / "overhead.json"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "bench_step_overhead.py"),
         "--batch", "4", "--skip", "3", "--steps", "5", "--output-kind", "final_only", "--queued", "6",
         "--policy", "shortest_prompt_first", "--prompt-words", "40", "--sampling", "benchmark", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert (report["batch"], report["output_tokens_before"], report["steps"]) == (4, 3, 5)
    assert report["output_kind"] == "final_only" and report["sampling"] == "benchmark"
    assert report["prompt_tokens"] > 40  # padded to a longer context
    assert (report["queued"], report["policy"]) == (6, "shortest_prompt_first")  # the batch stayed full all along
    assert report["ms_forward"] > 0 and report["ms_logits"] > 0 and report["ms_host"] > 0
    parts = report["ms_forward"] + report["ms_logits"] + report["ms_host"]
    assert parts == pytest.approx(report["ms_per_step"], rel=1e-9)
    assert "ms/step = forward" in result.stdout


def test_gpu_paths_time_the_forwards_host_work_with_the_launches_skipped(tmp_path):
    """--gpu-paths: the decode forward takes the GPU code paths with every Triton launch skipped;
    the launches it counts per step are a decode step's census (tests/kernels/test_engine_on_triton.py:
    per layer the add-and-norm with the router's logits, routing and align, the norm that sums the
    MoE's terms, paged decode, the two MoE GEMMs; the final norm)."""
    out = tmp_path / "overhead.json"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "bench_step_overhead.py"), "--gpu-paths",
         "--batch", "4", "--skip", "2", "--steps", "3", "--output-kind", "final_only", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    layers = report["layers"]
    assert report["gpu_paths"] is True and layers >= 1
    assert report["launches_per_step"] == {
        "rms_norm_kernel": layers + 1,
        "add_rms_norm_router_kernel": layers,  # batch 4: the post-attention norm, router, routing and align
        "paged_decode_split_kernel": layers,
        "moe_gate_up_silu_kernel": layers,
        "moe_down_kernel": layers,
    }
    assert report["triton_launches_per_step"] == 5 * layers + 1
    assert report["ms_forward_per_layer"] == pytest.approx(report["ms_forward"] / layers)
    assert "ms per layer" in result.stdout
