"""Which fused kernel `F.scaled_dot_product_attention` runs for the vision tower's long images.

Images of `SDPA_MIN_SEGMENT_LEN` patches or more go through SDPA one segment at a time
(`kernels.varlen_attention`): most of the vision tower's attention FLOPs, and on the H100 of
2026-11-27 about 313 TFLOP/s (FlashAttention 2, heads of 72). cuDNN's fused attention is a
Hopper kernel that torch reaches through the same call, and PyTorch measured it up to 1.75x
FlashAttention 2 on an H100 (the 2.5 release notes); torch does not rank it first, so it is
asked for here:

`VLM_CATALOG_SDPA_BACKEND` = ``default`` (torch's own order) | ``cudnn`` (cuDNN first, then
torch's others, so an input cuDNN refuses still runs). The default stays torch's until the
kernels phase's ``varlen_attention[sdpa, cudnn]`` rows have measured cuDNN on a GPU, and
``test_gpu_cudnn_sdpa_matches_the_reference`` has checked it there.
"""

from __future__ import annotations

import contextlib

from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.dispatch import environment_choice

SDPA_BACKEND_ENV_VAR = "VLM_CATALOG_SDPA_BACKEND"
SDPA_BACKENDS = ("default", "cudnn")
# cuDNN first; every other backend after it, in torch's order, so nothing is refused
CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
               SDPBackend.MATH]


def sdpa_backend() -> str:
    """The setting of `VLM_CATALOG_SDPA_BACKEND` (``default`` when unset); anything else is an error."""
    return environment_choice(SDPA_BACKEND_ENV_VAR, SDPA_BACKENDS)


def long_segment_sdpa(backend: str | None = None) -> contextlib.AbstractContextManager:
    """The context the long segments' SDPA calls run in: `backend` (default: the setting)."""
    backend = sdpa_backend() if backend is None else backend
    if backend == "cudnn":
        return sdpa_kernel(CUDNN_FIRST, set_priority=True)
    if backend != "default":
        raise ValueError(f"unknown SDPA backend {backend!r}: one of {', '.join(SDPA_BACKENDS)}")
    return contextlib.nullcontext()
