"""Programmatic dependent launch (PDL, Hopper and later): a kernel may be launched while the one
before it in the stream is still finishing, so its launch and set-up overlap that kernel's tail.

A decode step is hundreds of small kernels in a CUDA graph (about 11 per layer at batch 1),
and each boundary between two of them leaves the GPU idle for the next kernel's launch and
ramp-up. With ``VLM_CATALOG_PDL=1`` our Triton kernels are launched with Triton's
``launch_pdl=True``; each of them begins by waiting for the grid before it
(`kernels/jit/pdl.py`: ``griddepcontrol.wait``, which returns once that grid has finished and
its memory is visible), before touching any memory, and then lets the next grid launch: at
once, or, in the kernels of the batch-1 decode step (the projections, decode attention, the
norm-and-router launch and the experts), after their main loop, so that the next launch hides
behind this grid's epilogue (kernels/jit/pdl.py: what is known of the early trigger). So a kernel
computes exactly as it does without PDL, and only the launches overlap. The skinny projections
and the norm-and-router launch also ask for their weights into L2 before the wait
(`prefetches_weights`, kernels/jit/l2_prefetch.py): no grid writes them, and they then stream
in while the grid before finishes. Kernels of other
libraries (cuBLAS, torch) are launched as usual and wait as usual.

Off by default: bench_gpu.py's roofline phase times the batch-1 decode step both ways
(``decode_batch1_pdl``). On the H200 of 2026-11-27 PDL made it slower, 4.47 ms against
3.93 in CUDA graphs, when every kernel let the next launch at its start and three cuBLAS
GEMMs per layer broke the chain; both have changed since (2026-11-28, untimed). Only CUDA tensors on a device of compute
capability 9.0 or more are launched this way; elsewhere, and under the Triton interpreter,
`launch_options` asks for nothing.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from kernels.dispatch import environment_flag, environment_variable, kernels_off

PDL_ENV_VAR = "VLM_CATALOG_PDL"
PDL_MIN_CAPABILITY = (9, 0)
L2_LINE_BYTES = 128  # what one `prefetch.global.L2` brings (kernels/jit/l2_prefetch.py)


def programmatic_dependent_launch(enabled: bool) -> contextlib.AbstractContextManager:
    """Sets ``VLM_CATALOG_PDL`` for the block (`kernels.dispatch.environment_variable`: the roofline
    phase captures one decode graph each way)."""
    return environment_variable(PDL_ENV_VAR, "1" if enabled else "0")


def pdl_requested() -> bool:
    """Whether ``VLM_CATALOG_PDL`` asks for it (unset, "" or "0": no)."""
    return environment_flag(PDL_ENV_VAR)


def launch_options(tensor: torch.Tensor) -> dict[str, bool]:
    """The extra launch keywords of a Triton kernel whose tensors are on `tensor`'s device:
    ``{"launch_pdl": True}`` where PDL is requested and the device takes it, else none."""
    if not pdl_requested() or tensor.device.type != "cuda":
        return {}
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    return {"launch_pdl": True} if _device_takes_pdl(index) else {}


def prefetches_weights(options: dict[str, bool]) -> bool:
    """Whether a kernel launched with `options` (`launch_options`' answer) asks for its weights into
    L2 before it waits for the grid before it (kernels/jit/l2_prefetch.py): where the launch uses
    PDL, unless ``VLM_CATALOG_KERNELS_OFF`` names `pdl_weight_prefetch`. Without PDL the wait
    returns at once, and the prefetches would only come just ahead of the loads themselves."""
    return bool(options.get("launch_pdl")) and "pdl_weight_prefetch" not in kernels_off()


def line_elements(tensor: torch.Tensor) -> int:
    """Elements of `tensor` in one L2 line: the column step of `prefetch_rows_to_l2`."""
    return max(1, L2_LINE_BYTES // tensor.element_size())


def weight_prefetch_meta(options: dict[str, bool], weight: torch.Tensor, num_warps: int, rows_per_program: int,
                         prefetch_weight: bool | None = None) -> dict[str, object]:
    """The meta-parameters of a kernel that prefetches `rows_per_program` rows of `weight` per
    program on `num_warps` warps (kernels/jit/l2_prefetch.py), launched with `options`:
    PREFETCH_WEIGHT (`prefetch_weight`; None: `prefetches_weights(options)`), LINE_ELEMENTS, and
    PREFETCH_LINES, about one line per thread."""
    return dict(PREFETCH_WEIGHT=prefetches_weights(options) if prefetch_weight is None else prefetch_weight,
                LINE_ELEMENTS=line_elements(weight), PREFETCH_LINES=max(1, 32 * num_warps // rows_per_program))


@functools.cache
def _device_takes_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= PDL_MIN_CAPABILITY
