"""A serving run after the engine's warm-up compiles no Triton kernel variant: the warm-up
launched every one the run launches (`tests/engine/warmup_variants.py`, at Qwen3-VL-30B-A3B's
widths, in a subprocess without the Triton interpreter, which replaces `triton.jit`).

On 2026-11-28 the run of 32 catalogue records launched variants the warm-up had not: the
decode and rotary kernels' positions stride in a new class (a step of a multiple of 16 tokens),
and under FlashAttention 2 the varlen and paged prefill Triton kernels, which take the short
sequences of a call whose long ones go to SDPA. The default run emulates FlashAttention 2 (about
40 s on a 2-core VM); FlashAttention 3's choices, a subset of those launches, are `slow`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# kernels every run must have launched, or the comparison proves little
KERNELS_EVERY_RUN_LAUNCHES = {"paged_decode_split_kernel", "moe_gate_up_silu_kernel", "moe_down_kernel",
                              "fp8_linear_kernel", "qk_norm_mrope_kernel", "reshape_and_cache_kernel",
                              "route_topk_align_kernel", "vision_rotary_kernel"}


def run_variants(tmp_path: Path, flash: str) -> dict:
    pytest.importorskip("triton")
    env = {key: value for key, value in os.environ.items()
           if key not in ("TRITON_INTERPRET", "VLM_CATALOG_KERNELS", "VLM_CATALOG_KERNELS_OFF")}
    report = tmp_path / "variants.json"
    result = subprocess.run(
        [sys.executable, "-m", "tests.engine.warmup_variants", "--flash", flash, "--json", str(report)],
        cwd=REPO_ROOT, env=env, check=False, capture_output=True, text=True, timeout=900,
    )
    assert report.is_file(), result.stdout + result.stderr
    variants = json.loads(report.read_text())
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert not variants["missing"]
    return variants


def check_the_run_was_a_real_one(variants: dict) -> None:
    assert variants["run_steps"] >= 6 and variants["warmup_steps"] > variants["run_steps"]
    assert KERNELS_EVERY_RUN_LAUNCHES <= set(variants["run"]), sorted(variants["run"])
    # what its prefill-sized forwards asked of the host: the expert GEMMs launched once each per
    # layer, and the torch ops besides (allocations and views among them) counted
    prefill = variants["prefill_forward"]
    assert prefill["forwards"] >= 1 and prefill["tokens_mean"] > 1024 and prefill["layers"] == 1
    assert prefill["launches_by_kernel"]["moe_gate_up_silu_kernel"] == 1.0
    assert prefill["launches_by_kernel"]["moe_down_kernel"] == 1.0
    assert prefill["triton_launches"] >= 8 and prefill["torch_ops"] > prefill["triton_launches"]
    assert prefill["torch_ops_by_name"]["zeros"] >= 1  # allocations (torch.empty is torch.zeros here)


def test_a_run_after_the_warmup_compiles_nothing_with_flash_attention_2(tmp_path):
    variants = run_variants(tmp_path, "fa2")
    check_the_run_was_a_real_one(variants)
    # the short sequences of calls whose long ones went to SDPA
    assert {"varlen_attention_kernel", "paged_prefill_attention_kernel"} <= set(variants["run"])


@pytest.mark.slow
def test_a_run_after_the_warmup_compiles_nothing_with_flash_attention_3(tmp_path):
    variants = run_variants(tmp_path, "fa3")
    check_the_run_was_a_real_one(variants)
    # FlashAttention 3 takes every length: those Triton kernels stay out of the run
    assert not {"varlen_attention_kernel", "paged_prefill_attention_kernel"} & set(variants["run"])
