"""Backend selection and the CPU-only import guarantee."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels import dispatch
from kernels.rms_norm import rms_norm_reference

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_import_kernels_does_not_import_triton():
    code = (
        "import sys, kernels, torch\n"
        "x = torch.randn(2, 8)\n"
        "kernels.rms_norm(x, torch.ones(8), 1e-6)\n"
        "kernels.route_topk_and_align(x, 2, block_size=16)\n"  # what every MoE layer calls first
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        check=False,
        text=True,
        env={"PATH": "", "VLM_CATALOG_KERNELS": "auto"},
    )
    assert result.returncode == 0, result.stderr


def test_auto_on_cpu_tensors_uses_the_reference(monkeypatch):
    monkeypatch.delenv(dispatch.BACKEND_ENV_VAR, raising=False)
    assert dispatch.kernel_backend() == "auto"
    assert not dispatch.use_triton(torch.randn(2), op="rms_norm")


def test_auto_takes_triton_on_the_device_types_listed(monkeypatch):
    # the interpreted end-to-end test lists "cpu" to make the CUDA choices on CPU tensors
    monkeypatch.delenv(dispatch.BACKEND_ENV_VAR, raising=False)
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setattr(dispatch, "AUTO_DEVICE_TYPES", ("cuda", "cpu"))
    assert dispatch.use_triton(torch.randn(2), torch.randn(3), op="rms_norm")
    monkeypatch.setattr(dispatch, "AUTO_DEVICE_TYPES", ("cuda",))
    assert not dispatch.use_triton(torch.randn(2), op="rms_norm")


def test_reference_backend_is_forced(monkeypatch):
    monkeypatch.setenv(dispatch.BACKEND_ENV_VAR, "reference")
    assert not dispatch.use_triton(torch.randn(2), op="rms_norm")


def test_triton_backend_is_forced(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv(dispatch.BACKEND_ENV_VAR, "triton")
    assert dispatch.use_triton(torch.randn(2), op="rms_norm")


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("VLM_CATALOG_KERNELS", "cuda", "VLM_CATALOG_KERNELS='cuda' is not one of"),
    ("VLM_CATALOG_KERNELS_OFF", "fused_moe,flash_attention", "VLM_CATALOG_KERNELS_OFF names flash_attention.*fused_moe"),
])
def test_a_wrong_setting_is_an_error_naming_it(monkeypatch, variable, value, message):
    """On the first op, and before: an engine refuses to start (a typo must not fail every request)."""
    from vlm_catalog.engine.config import EngineConfig, EngineConfigError

    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=message):
        dispatch.use_triton(torch.randn(2), op="rms_norm")
    with pytest.raises(EngineConfigError, match=message):
        EngineConfig()


@pytest.mark.parametrize(("variable", "value"), [
    ("VLM_CATALOG_KV_LAYOUT", "x"), ("VLM_CATALOG_PDL", "maybe"), ("VLM_CATALOG_MOE_GEMM", "cutlass"),
    ("VLM_CATALOG_SDPA_BACKEND", "magic"), ("VLM_CATALOG_FLASH_VARLEN", "fa4"),
    ("VLM_CATALOG_VARLEN_ATTENTION", "fast"), ("VLM_CATALOG_PREFILL_ATTENTION", "fast"),
])
def test_every_kernel_switch_is_checked_when_the_engine_starts(monkeypatch, variable, value):
    """Only three of the ten were: `VLM_CATALOG_KV_LAYOUT=x` was a traceback in the first request,
    and on the CPU, where the attention and MoE switches are never read, a typo went unseen."""
    from vlm_catalog.engine.config import EngineConfig, EngineConfigError

    monkeypatch.setenv(variable, value)
    with pytest.raises(EngineConfigError, match=f"{variable}='{value}' is not"):
        EngineConfig()


def test_triton_kernels_asked_for_on_the_cpu_need_the_interpreter(monkeypatch):
    """`VLM_CATALOG_KERNELS=triton` on the CPU failed the first request with Triton's "0 active drivers"."""
    from vlm_catalog.engine.config import EngineConfig, EngineConfigError

    monkeypatch.setenv(dispatch.BACKEND_ENV_VAR, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(EngineConfigError, match="VLM_CATALOG_KERNELS=triton runs the Triton kernels, which need a CUDA"):
        EngineConfig()
    assert EngineConfig(device="cuda").device == "cuda"  # checked where they run, not here
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert EngineConfig().device == "cpu"


def test_fp8_fast_accumulation_is_a_flag_and_a_wrong_value_stops_the_engine(monkeypatch):
    from kernels.fp8 import imprecise_accumulation
    from vlm_catalog.engine.config import EngineConfig, EngineConfigError

    monkeypatch.delenv(dispatch.FP8_FAST_ACCUMULATION_ENV_VAR, raising=False)
    # unset: per-channel FP8 x FP8 sums go into float32 every K step (BLOCK_K products)
    assert not dispatch.fp8_fast_accumulation() and imprecise_accumulation(128) == 128
    for value, fast in (("1", True), ("on", True), ("0", False), ("", False), (" TRUE ", True)):
        monkeypatch.setenv(dispatch.FP8_FAST_ACCUMULATION_ENV_VAR, value)
        assert dispatch.fp8_fast_accumulation() is fast, value
        assert imprecise_accumulation(64) == (None if fast else 64)  # None: Triton's default
    monkeypatch.setenv(dispatch.FP8_FAST_ACCUMULATION_ENV_VAR, "fast")
    with pytest.raises(ValueError, match="VLM_CATALOG_FP8_FAST_ACCUMULATION='fast' is not a flag"):
        dispatch.fp8_fast_accumulation()
    with pytest.raises(EngineConfigError, match="VLM_CATALOG_FP8_FAST_ACCUMULATION"):
        EngineConfig()


@pytest.mark.parametrize("previous", [None, "1", "0"])
def test_fp8_accumulation_sets_the_flag_for_a_block_and_puts_back_what_was_there(monkeypatch, previous):
    variable = dispatch.FP8_FAST_ACCUMULATION_ENV_VAR
    if previous is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, previous)
    for fast in (True, False):
        with pytest.raises(KeyError), dispatch.fp8_accumulation(fast):  # put back on the way out of an error too
            assert dispatch.fp8_fast_accumulation() is fast
            raise KeyError
        assert os.environ.get(variable) == previous


def test_forced_triton_without_triton_is_an_error(monkeypatch):
    monkeypatch.setenv(dispatch.BACKEND_ENV_VAR, "triton")
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="triton"):
        dispatch.use_triton(torch.randn(2), op="rms_norm")


def test_ops_named_off_take_the_reference_and_the_rest_keep_triton(monkeypatch):
    monkeypatch.setenv(dispatch.BACKEND_ENV_VAR, "triton")
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setenv(dispatch.KERNELS_OFF_ENV_VAR, " Fused_MoE, rms_norm ,")  # case, spaces, empty items
    assert dispatch.kernels_off() == {"fused_moe", "rms_norm"}
    assert not dispatch.use_triton(torch.randn(2), op="fused_moe")
    assert not dispatch.use_triton(torch.randn(2), op="rms_norm")
    assert dispatch.use_triton(torch.randn(2), op="fused_add_rms_norm")
    monkeypatch.setenv(dispatch.KERNELS_OFF_ENV_VAR, "")
    assert dispatch.use_triton(torch.randn(2), op="rms_norm")
    # the fast paths' names are taken too (their ops then run plain Triton code;
    # test_fp8_linear_cublas.py, test_fp8_widen.py)
    monkeypatch.setenv(dispatch.KERNELS_OFF_ENV_VAR,
                       "fp8_linear_cublas,fp8_widen_ptx,fp8_float16_dots,fp8_v_words,moe_grouped_gemm,"
                       "decode_qk_norm_rope,gelu_gemm_epilogue,decode_merge_in_place,norm_router_routes,"
                       "moe_gate_up_quantizes,norm_quantizes,decode_ids_ahead,moe_down_persistent,"
                       "decode_heads_together,pdl_weight_prefetch")
    assert dispatch.kernels_off() == {"fp8_linear_cublas", "fp8_widen_ptx", "fp8_float16_dots", "fp8_v_words",
                                      "moe_grouped_gemm", "decode_qk_norm_rope", "gelu_gemm_epilogue",
                                      "decode_merge_in_place", "norm_router_routes",
                                      "moe_gate_up_quantizes", "norm_quantizes",
                                      "decode_ids_ahead", "moe_down_persistent",
                                      "decode_heads_together", "pdl_weight_prefetch"} == dispatch.FAST_PATHS
    assert dispatch.use_triton(torch.randn(2), op="fp8_linear")


def test_an_op_outside_the_registry_is_refused():
    with pytest.raises(ValueError, match="'rms_norm_v2' is not in kernels.dispatch.KERNEL_OPS"):
        dispatch.use_triton(torch.randn(2), op="rms_norm_v2")


def test_every_registered_op_is_dispatched_somewhere():
    """The names the off switch takes are exactly the ops that ask `use_triton` (by op=...)."""
    asked = set()
    for path in (REPO_ROOT / "kernels").rglob("*.py"):
        if path.name == "dispatch.py":  # its docstring's example
            continue
        asked |= set(re.findall(r'use_triton\([^)]*op="(\w+)"\)', path.read_text()))
    assert asked == dispatch.KERNEL_OPS


def test_ops_route_through_the_dispatcher(monkeypatch):
    """With the backend forced to triton, the public op calls its Triton wrapper."""
    import kernels.rms_norm

    module = sys.modules["kernels.rms_norm"]
    calls = []
    monkeypatch.setattr(module, "rms_norm_triton", lambda *args: calls.append(args) or "triton")
    monkeypatch.setenv(dispatch.BACKEND_ENV_VAR, "triton")
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    assert kernels.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6) == "triton"
    monkeypatch.setenv(dispatch.BACKEND_ENV_VAR, "reference")
    x = torch.randn(2, 4)
    torch.testing.assert_close(
        kernels.rms_norm(x, torch.ones(4), 1e-6), rms_norm_reference(x, torch.ones(4), 1e-6)
    )
    assert len(calls) == 1


def test_public_api():
    for name in kernels.__all__:
        assert callable(getattr(kernels, name)), name
