"""Per-call choice between a Triton kernel and its plain-torch reference.

Every public op in `kernels` is a small function of the form::

    def op(x, ...):
        if use_triton(x, ..., op="op"):
            return op_triton(x, ...)
        return op_reference(x, ...)

`use_triton` reads the environment variable ``VLM_CATALOG_KERNELS`` on every call
(a dictionary lookup, so tests can flip it with ``monkeypatch.setenv``):

* unset or ``auto``: Triton when every tensor is on CUDA and triton imports,
  the torch reference otherwise (the CPU serving path);
* ``reference``: the torch reference everywhere;
* ``triton``: Triton everywhere. On CPU tensors this only works under the Triton
  interpreter (``TRITON_INTERPRET=1`` set before triton is imported); the
  interpreter tests in ``tests/kernels`` use it.

``VLM_CATALOG_KERNELS_OFF`` names ops (comma-separated, from `KERNEL_OPS`) that take
their torch reference even where Triton would run: the way out when one kernel fails
on a GPU (a compile error, a crash, a wrong answer) while the others stay fast. It
also takes the names in `FAST_PATHS`, faster code an op prefers where it can: a library
GEMM that passes a check (``fp8_linear_cublas``), inline PTX that widens e4m3 inside the
kernels (``fp8_widen_ptx``). Off, the op runs its plain Triton code instead. A
reference path may sync with the host, which CUDA-graph capture cannot take; the
engine then runs its decode steps eagerly (`engine/cuda_graphs.py`).

``VLM_CATALOG_FP8_FAST_ACCUMULATION=1`` lets the FP8 x FP8 GEMMs with one scale per row
(per-channel W8A8) sum their whole K loop in the tensor core's own accumulator, which on
an H100 keeps fewer bits than float32 (vLLM's choice, and Triton's default on sm_90;
cuBLAS's ``use_fast_accum``). Unset, those sums are added into float32 every K step
(`kernels.fp8.imprecise_accumulation`), as the block-scaled GEMMs' are.

Nothing here imports triton unless a call actually wants it, so a CPU-only
install never pays for (or needs) triton at start-up.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Iterator

import torch

BACKEND_ENV_VAR = "VLM_CATALOG_KERNELS"
BACKENDS = ("auto", "reference", "triton")
KERNELS_OFF_ENV_VAR = "VLM_CATALOG_KERNELS_OFF"
KERNEL_OPS = frozenset({  # every op that dispatches here: the names VLM_CATALOG_KERNELS_OFF takes
    "rms_norm", "fused_add_rms_norm", "fused_sum_add_rms_norm", "add_rms_norm_router", "qk_norm_mrope",
    "silu_and_mul",
    "reshape_and_cache", "paged_decode_attention", "paged_decode_attention_with_kv_write",
    "paged_prefill_attention", "varlen_attention", "vision_rotary", "route_topk", "route_topk_and_align",
    "moe_align_block_size", "fused_moe", "fp8_linear", "quantize_activations", "skinny_linear",
})
# faster code an op prefers where it can (a library GEMM that passes a check, inline PTX);
# VLM_CATALOG_KERNELS_OFF takes their names too, and then the op runs its plain Triton code
FAST_PATHS = frozenset({
    "fp8_linear_cublas",  # kernels/fp8_linear_cublas.py
    "fp8_widen_ptx",  # kernels/jit/fp8_widen.py, kernels/jit/paged_decode_attention.py
    # paged attention over an FP8 cache: both dots in float16 (off: the query's dtype, bf16),
    # and the decode kernel's V read as 4-byte words (off: as bytes); on the H100 of 2026-11-27
    # the decode kernel with both ran slower than without either on 2026-11-25, so they can be
    # timed apart (kernels/attention_common.py, jit/paged_decode_attention.py)
    "fp8_float16_dots",
    "fp8_v_words",
    "moe_grouped_gemm",  # kernels/moe/grouped_gemm.py (only where VLM_CATALOG_MOE_GEMM=grouped_mm asks)
    # the decode kernel norms and rotates a step's raw q and k itself (off: qk_norm_mrope's launch
    # first; kernels/paged_decode_attention.py)
    "decode_qk_norm_rope",
    # paged decode over several splits: each (sequence, KV head)'s last split to finish merges them
    # (off: the reduce kernel's own launch; kernels/arrival_counters.py)
    "decode_merge_in_place",
    # paged decode with 3 or more pipeline stages: each tile's cache blocks are loaded an iteration
    # before its K/V, so more than one tile is in flight (off: in the same iteration, which keeps
    # one; kernels/paged_decode_attention.py, loads_block_ids_ahead)
    "decode_ids_ahead",
    # paged decode: the split kernel's grid is (KV head, sequence, split), a sequence's heads side
    # by side (off: (sequence, KV head, split); kernels/paged_decode_attention.py)
    "decode_heads_together",
    # add_rms_norm_route: the norm-and-router launch's last program routes and lays the pairs out
    # too (off: route_topk_and_align's own launch; kernels/norm_router.py)
    "norm_router_routes",
    # the vision MLP's bias and tanh GELU in cuBLASLt's GEMM epilogue (off: F.linear, then F.gelu;
    # kernels/linear_gelu.py)
    "gelu_gemm_epilogue",
    # the fused MoE's gate/up epilogue writes the down GEMM's FP8 input where its tile holds one
    # group (off: a quantize_activations launch between the GEMMs; kernels/moe/fused_moe.py)
    "moe_gate_up_quantizes",
    # the RMSNorm before a W8A8 GEMM (q/k/v on cuBLAS, the fused MoE) writes that GEMM's FP8 input
    # itself (off: the norm writes 16 bits, the GEMM quantizes them; kernels/fp8_input.py)
    "norm_quantizes",
    # the fused MoE's down GEMM on the prefill tiles: one program per SM walking its tiles in one
    # flattened loop (off: one program per tile; kernels/moe/fused_moe.py, down_runs_persistent)
    "moe_down_persistent",
    # a kernel launched with programmatic dependent launch asks for its weights into L2 before it
    # waits for the grid before it: the skinny projections and the norm-and-router launch (off: it
    # reads nothing before the wait; kernels/pdl.py, kernels/jit/l2_prefetch.py)
    "pdl_weight_prefetch",
})
FP8_FAST_ACCUMULATION_ENV_VAR = "VLM_CATALOG_FP8_FAST_ACCUMULATION"
AUTO_DEVICE_TYPES = ("cuda",)  # where `auto` picks Triton; a test adds "cpu" to run the GPU choices interpreted


def environment_choice(name: str, choices: tuple[str, ...]) -> str:
    """The setting of the variable `name`: one of `choices`, the first when unset or empty (case
    and surrounding spaces ignored); anything else is an error naming the variable and the choices."""
    choice = os.environ.get(name, "").strip().lower() or choices[0]
    if choice not in choices:
        raise ValueError(f"{name}={choice!r} is not one of {', '.join(choices)}")
    return choice


def kernel_backend() -> str:
    """The backend requested through ``VLM_CATALOG_KERNELS`` (default ``auto``)."""
    return environment_choice(BACKEND_ENV_VAR, BACKENDS)


def kernels_off() -> frozenset[str]:
    """The ops ``VLM_CATALOG_KERNELS_OFF`` sends to their torch reference (empty when unset)."""
    return _parse_kernels_off(os.environ.get(KERNELS_OFF_ENV_VAR, ""))


def fp8_fast_accumulation() -> bool:
    """Whether ``VLM_CATALOG_FP8_FAST_ACCUMULATION`` asks for the tensor core's own accumulator
    across whole K loops in per-channel FP8 x FP8 GEMMs (module doc); unset, "" or "0": no."""
    return environment_flag(FP8_FAST_ACCUMULATION_ENV_VAR)


def environment_flag(name: str) -> bool:
    """The on/off setting of the variable `name`: unset, "", "0", "false", "no" or "off" is off;
    "1", "true", "yes" or "on" is on; anything else is an error naming the variable."""
    return _parse_flag(name, os.environ.get(name, ""))


@contextlib.contextmanager
def environment_variable(name: str, value: str) -> Iterator[None]:
    """Sets the variable `name` for the block (the benchmarks time a switch both ways in one
    process), then puts back what was there."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


def fp8_accumulation(fast: bool) -> contextlib.AbstractContextManager:
    """Sets ``VLM_CATALOG_FP8_FAST_ACCUMULATION`` for the block (`environment_variable`)."""
    return environment_variable(FP8_FAST_ACCUMULATION_ENV_VAR, "1" if fast else "0")


@functools.cache
def _parse_flag(name: str, value: str) -> bool:
    value = value.strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={value!r} is not a flag; use 1 or 0")


@functools.cache
def _parse_kernels_off(value: str) -> frozenset[str]:
    names = frozenset(name.strip().lower() for name in value.split(",") if name.strip())
    unknown = names - KERNEL_OPS - FAST_PATHS
    if unknown:
        raise ValueError(
            f"{KERNELS_OFF_ENV_VAR} names {', '.join(sorted(unknown))}, which is not a kernel op; "
            f"the ops are {', '.join(sorted(KERNEL_OPS | FAST_PATHS))}"
        )
    return names


def widens_with_ptx(kernel) -> bool:
    """Whether a launch of the @triton.jit `kernel` may widen e4m3 with inline PTX: it is compiled
    for a GPU (the interpreter runs no PTX) and ``fp8_widen_ptx`` is not turned off."""
    from triton.runtime.jit import JITFunction

    return isinstance(kernel, JITFunction) and "fp8_widen_ptx" not in kernels_off()


@functools.cache
def triton_available() -> bool:
    """True when triton imports (checked once, lazily)."""
    try:
        importlib.import_module("triton")
    except Exception:  # noqa: BLE001 - ImportError, or a broken install raising anything else
        return False
    return True


def use_triton(*tensors: torch.Tensor, op: str) -> bool:
    """Whether `op` (one of `KERNEL_OPS`) called on `tensors` should run its Triton kernel."""
    if op not in KERNEL_OPS:
        raise ValueError(f"{op!r} is not in kernels.dispatch.KERNEL_OPS")
    backend = kernel_backend()
    if backend == "reference" or op in kernels_off():
        return False
    if backend == "triton":
        if not triton_available():
            raise RuntimeError(
                f"{BACKEND_ENV_VAR}=triton but triton cannot be imported; "
                "install the 'gpu' extra or unset the variable"
            )
        return True
    return all(t.device.type in AUTO_DEVICE_TYPES for t in tensors) and triton_available()
