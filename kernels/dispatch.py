"""Per-call choice between a Triton kernel and its plain-torch reference.

Every public op in `kernels` is a small function of the form::

    def op(x, ...):
        if use_triton(x, ...):
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

Nothing here imports triton unless a call actually wants it, so a CPU-only
install never pays for (or needs) triton at start-up.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

BACKEND_ENV_VAR = "VLM_CATALOG_KERNELS"
BACKENDS = ("auto", "reference", "triton")
AUTO_DEVICE_TYPES = ("cuda",)  # where `auto` picks Triton; a test adds "cpu" to run the GPU choices interpreted


def kernel_backend() -> str:
    """The backend requested through ``VLM_CATALOG_KERNELS`` (default ``auto``)."""
    backend = os.environ.get(BACKEND_ENV_VAR, "auto").strip().lower() or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV_VAR}={backend!r} is not one of {', '.join(BACKENDS)}")
    return backend


@functools.cache
def triton_available() -> bool:
    """True when triton imports (checked once, lazily)."""
    try:
        importlib.import_module("triton")
    except Exception:  # noqa: BLE001 - ImportError, or a broken install raising anything else
        return False
    return True


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether an op called on `tensors` should run its Triton kernel."""
    backend = kernel_backend()
    if backend == "reference":
        return False
    if backend == "triton":
        if not triton_available():
            raise RuntimeError(
                f"{BACKEND_ENV_VAR}=triton but triton cannot be imported; "
                "install the 'gpu' extra or unset the variable"
            )
        return True
    return all(t.device.type in AUTO_DEVICE_TYPES for t in tensors) and triton_available()
