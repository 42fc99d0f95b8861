"""Every Triton kernel compiles for an H100 (sm_90), here, without a GPU.

Runs `tests/kernels/sm90_compile.py` in a subprocess: the compiler needs the real
`triton.jit` functions, which the interpreter set up by this directory's
conftest replaces. bfloat16 kernels in the default suite (~30 s on 2 cores);
the float32 attention variants (exact dot products, slow to compile) are `slow`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_compile(*flags: str) -> subprocess.CompletedProcess:
    pytest.importorskip("triton")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return subprocess.run(
        [sys.executable, "-m", "tests.kernels.sm90_compile", *flags],
        cwd=REPO_ROOT,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_kernels_compile_for_sm90():
    result = run_compile()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAILED" not in result.stdout


@pytest.mark.slow
def test_float32_attention_kernels_compile_for_sm90():
    result = run_compile("--float32")
    assert result.returncode == 0, result.stdout + result.stderr
