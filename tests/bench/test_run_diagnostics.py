"""vlm_catalog/bench/run_diagnostics.py: what a timed run paid for besides its work (Triton
variants first launched, Python's collections, the CUDA allocator's calls), and the line
scripts/gpu_record_summary.py prints for it."""

from __future__ import annotations

import gc
import importlib.util
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from tests.bench.test_gpu_record_summary import load_summary
from vlm_catalog.bench.run_diagnostics import RunDiagnostics


@pytest.fixture
def triton():
    """triton, imported in the test: imported while the suite collects, it would build its language
    functions before tests/kernels/conftest.py asks for the interpreter, and the kernel tests
    after it in the same process would fail."""
    return pytest.importorskip("triton")


def test_collections_inside_the_block_are_counted_by_generation_and_timed():
    callbacks_before = list(gc.callbacks)
    with RunDiagnostics("cpu") as diagnostics:
        gc.collect()
        gc.collect(1)
    summary = diagnostics.summary()
    assert summary["gc"]["collections"].get("2", 0) >= 1 and summary["gc"]["collections"].get("1", 0) >= 1
    assert summary["gc"]["seconds"] > 0
    assert gc.callbacks == callbacks_before  # the callback left with the block
    assert summary["cuda_allocator"] is None  # off CUDA


def compile_events(runtime, name: str, key: str) -> object:
    """What Triton's JITFunction does for a variant its process has not launched yet: the
    pre-compile hook (a true answer skips the compile), the compile, the post-compile hook."""
    from triton.runtime.jit import JitFunctionInfo

    fields = dict(key=key, repr=f"{name}[num_warps=4](x: *fp32)", fn=JitFunctionInfo(ModuleType("m"), name, None),
                  compile={"key": key}, is_manual_warmup=False, already_compiled=False)
    skipped = runtime.jit_cache_hook(**fields) if runtime.jit_cache_hook else None
    if runtime.jit_post_compile_hook:
        runtime.jit_post_compile_hook(**fields)
    return skipped


def test_triton_variants_are_counted_per_kernel_chained_to_the_hooks_there_and_put_back(monkeypatch, triton):
    runtime = triton.knobs.runtime
    seen = []
    monkeypatch.setattr(runtime, "jit_cache_hook", lambda **kwargs: seen.append(("cache", kwargs["key"])) or True)
    monkeypatch.setattr(runtime, "jit_post_compile_hook", lambda **kwargs: seen.append(("post", kwargs["key"])))
    installed = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    with RunDiagnostics() as diagnostics:
        assert compile_events(runtime, "moe_down_kernel", "k1") is True  # the hook there still decides
        compile_events(runtime, "moe_down_kernel", "k2")
        compile_events(runtime, "rms_norm_kernel", "k1")
    compile_events(runtime, "rms_norm_kernel", "k3")  # after the block: not counted
    assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == installed
    assert seen[:2] == [("cache", "k1"), ("post", "k1")] and len(seen) == 8
    summary = diagnostics.summary()
    assert {name: v["count"] for name, v in summary["triton_variants"].items()} == {
        "moe_down_kernel": 2, "rms_norm_kernel": 1}
    assert summary["triton_variant_seconds"] >= 0


def test_no_triton_hooks_where_triton_lacks_them(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", SimpleNamespace())  # a triton without knobs
    with RunDiagnostics() as diagnostics:
        pass
    assert diagnostics.summary()["triton_variants"] is None


def test_the_record_summary_prints_a_runs_diagnostics_in_one_line():
    line = load_summary().diagnostics_line({
        "triton_variants": {"paged_decode_split_kernel": {"count": 12, "seconds": 0.75},
                            "rms_norm_kernel": {"count": 2, "seconds": 0.25}},
        "triton_variant_seconds": 1.0, "gc": {"collections": {"0": 40, "2": 1}, "seconds": 0.5},
        "cuda_allocator": {"num_device_alloc": 7, "num_device_free": 3, "num_alloc_retries": 1,
                           "num_sync_all_streams": 1, "num_ooms": 0, "num_host_alloc": 5, "host_alloc_seconds": 0.25}})
    assert line == ("14 Triton variants first launched, 1.00 s (paged_decode_split_kernel x12 0.75 s, "
                    "rms_norm_kernel x2 0.25 s); 41 collections 0.50 s; cudaMalloc 7, cudaFree 3, "
                    "retries after an OOM 1; 5 pinned blocks, 0.25 s")
    assert load_summary().diagnostics_line(None) is None


@pytest.fixture
def cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")


FRESH_KERNEL = """
import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * FACTOR, mask=mask)
"""


@pytest.mark.gpu
def test_gpu_a_kernel_variant_first_launched_in_the_block_is_counted(cuda_device, triton, tmp_path):
    (tmp_path / "fresh_kernel.py").write_text(FRESH_KERNEL)  # a kernel no other test launched
    spec = importlib.util.spec_from_file_location("fresh_kernel", tmp_path / "fresh_kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x = torch.ones(1000, device=cuda_device)
    module.scale_kernel[(8,)](x, 1000, FACTOR=2.0, BLOCK=128)  # this variant compiled before the block
    with RunDiagnostics(cuda_device) as diagnostics:
        module.scale_kernel[(8,)](x, 1000, FACTOR=2.0, BLOCK=128)  # launched before: not counted
        module.scale_kernel[(8,)](x, 1000, FACTOR=3.0, BLOCK=128)  # a new constexpr: a new variant
        torch.cuda.synchronize(cuda_device)
    summary = diagnostics.summary()
    assert {name: v["count"] for name, v in summary["triton_variants"].items()} == {"scale_kernel": 1}
    assert x[0].item() == 12.0
    assert set(summary["cuda_allocator"]) >= {"num_device_alloc", "num_alloc_retries", "num_host_alloc",
                                              "host_alloc_seconds"}
