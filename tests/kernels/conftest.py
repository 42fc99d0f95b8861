"""Fixtures for the kernel tests.

Triton under the interpreter: without a CUDA device, `TRITON_INTERPRET=1` is set
by tests/conftest.py, before any test module is collected and so before anything
imports triton (its language functions and our jit'd kernels decide interpreter
vs compiler when they are defined). With a CUDA device the same tests run the
compiled kernels on the GPU instead. The variable only matters to code that runs
Triton kernels, so leaving it set for the session does not change any other test
module.

`VLM_CATALOG_KERNELS=triton` is set per test, through `monkeypatch`, only by the
`triton_device` fixture, so it never leaks out of a Triton test.
"""

from __future__ import annotations

import importlib
import os
import sys
import zlib

import pytest
import torch


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    """Fresh, reproducible random inputs: each test gets its own seed from its id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def triton_device(monkeypatch) -> torch.device:
    """The device for Triton tests (CPU under the interpreter, else CUDA), with
    VLM_CATALOG_KERNELS=triton for the duration of the test."""
    pytest.importorskip("triton")
    if _interpreting():
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1) or a CUDA device")
    monkeypatch.setenv("VLM_CATALOG_KERNELS", "triton")
    return device


@pytest.fixture
def cuda_device(monkeypatch) -> torch.device:
    """For @pytest.mark.gpu tests: a real CUDA device with compiled kernels."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if _interpreting():
        pytest.skip("TRITON_INTERPRET is set: GPU tests need compiled kernels")
    monkeypatch.setenv("VLM_CATALOG_KERNELS", "auto")
    return torch.device("cuda")


@pytest.fixture
def poison_allocations(monkeypatch):
    """Every `torch.empty` / `torch.empty_like` during the test comes back filled with
    NaN (floating) or a large negative number (integer), so an output element a
    kernel forgets to write shows up instead of passing by luck."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        elif tensor.dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
            tensor.fill_(-(2**30) if tensor.dtype in (torch.int32, torch.int64) else -100)
        return tensor

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))


@pytest.fixture
def fake_flash(monkeypatch):
    """install(fake) puts `fake` in place of torch's kernel, on CPU tensors too, with no
    failure remembered and no backend forced by the environment."""
    module = importlib.import_module("kernels.flash_varlen")
    monkeypatch.setattr(module, "_failures", {})
    monkeypatch.setattr(module, "_alignment_checked", set())
    monkeypatch.setattr(module, "_warned", set())
    monkeypatch.setattr(module, "FLASH_DEVICE_TYPES", ("cuda", "cpu"))
    for env_var in ("VLM_CATALOG_VARLEN_ATTENTION", "VLM_CATALOG_PREFILL_ATTENTION", "VLM_CATALOG_FLASH_VARLEN"):
        monkeypatch.delenv(env_var, raising=False)

    def install(fake):
        monkeypatch.setattr(module, "flash_varlen_function", lambda: fake)
        return fake

    return install


@pytest.fixture
def fake_fa3(monkeypatch, fake_flash):
    """install(function, interface=..., float16=...) makes `function` FlashAttention 3's varlen
    call of an install named `interface` (tests.kernels.flash_fakes.fa3_modules) on a Hopper
    GPU, as far as `kernels.flash_varlen` can tell, with no FA3 module importable otherwise;
    the provider stays torch's until `VLM_CATALOG_FLASH_VARLEN=fa3`."""
    from tests.kernels.flash_fakes import fa3_modules

    module = importlib.import_module("kernels.flash_varlen")
    monkeypatch.setattr(module, "fa3_device_supported", lambda: True)
    monkeypatch.setattr(module, "_fa3_import_errors", [])
    for interface, config in module.FA3_MODULES:
        monkeypatch.setitem(sys.modules, interface, None)  # import raises ImportError
        monkeypatch.setitem(sys.modules, config, None)
    module.fa3_varlen_function.cache_clear()

    def install(function, interface: str = "fa3_fwd_interface", float16: bool = False):
        for name, entry in fa3_modules(function, interface, float16).items():
            monkeypatch.setitem(sys.modules, name, entry)
        module.fa3_varlen_function.cache_clear()
        return function

    yield install
    module.fa3_varlen_function.cache_clear()

