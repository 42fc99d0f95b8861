"""Every `VLM_CATALOG_*` variable the kernels read, checked at once.

The kernels read their switches on every call, and on the CPU most are never
read at all: a typo (`VLM_CATALOG_KV_LAYOUT=x`) was a traceback in the first
request on one machine and silently nothing on another. `check_environment`
reads them all, so the engine refuses a bad value when it starts.
"""

from __future__ import annotations

from kernels.dispatch import (
    BACKEND_ENV_VAR,
    environment_choice,
    fp8_fast_accumulation,
    kernel_backend,
    kernels_off,
)


def check_environment(device_type: str) -> None:
    """`ValueError` naming the first variable set to something the kernels do not take, or asking
    for Triton kernels where they cannot run (`device_type` "cpu" without the Triton interpreter)."""
    from kernels.attention_common import forced_attention_backend
    from kernels.flash_varlen import FLASH_VARLEN_ENV_VAR, FLASH_VARLEN_PROVIDERS
    from kernels.jit.interpreter_compat import interpreter_enabled
    from kernels.kv_cache import kv_layout
    from kernels.moe.grouped_gemm import moe_gemm_choice
    from kernels.paged_prefill_attention import PREFILL_BACKEND_ENV_VAR, PREFILL_BACKENDS
    from kernels.pdl import pdl_requested
    from kernels.sdpa_backend import sdpa_backend
    from kernels.varlen_attention import VARLEN_BACKEND_ENV_VAR, VARLEN_BACKENDS

    backend = kernel_backend()
    kernels_off()
    fp8_fast_accumulation()
    kv_layout()
    pdl_requested()
    sdpa_backend()
    moe_gemm_choice()
    environment_choice(FLASH_VARLEN_ENV_VAR, FLASH_VARLEN_PROVIDERS)
    forced_attention_backend(VARLEN_BACKEND_ENV_VAR, VARLEN_BACKENDS)
    forced_attention_backend(PREFILL_BACKEND_ENV_VAR, PREFILL_BACKENDS)
    if backend == "triton" and device_type == "cpu" and not interpreter_enabled():
        raise ValueError(f"{BACKEND_ENV_VAR}=triton runs the Triton kernels, which need a CUDA device; on the CPU "
                         "set TRITON_INTERPRET=1 too (the interpreter: slow, for tests), or unset it")
