"""Small helpers shared by the attention wrappers."""

from __future__ import annotations

import functools
import math

import torch

from kernels.dispatch import environment_choice, kernels_off

LOG2_E = math.log2(math.e)


def forced_attention_backend(env_var: str, backends: tuple[str, ...] = ("triton", "sdpa")) -> str | None:
    """One of `backends` when `env_var` forces it for every sequence of a CUDA call, None when
    it is unset or ``auto`` (choose by length); anything else is a clear error."""
    choice = environment_choice(env_var, ("auto", *backends))
    return None if choice == "auto" else choice


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: exact float32 products for float32 inputs (tf32 would cost
    ~1e-3 relative error); 16-bit inputs ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def float16_dots(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the paged attention kernels run both dots in float16: an FP8 (e4m3) cache under a
    16-bit query (the reasons are in kernels/jit/paged_decode_attention.py), unless
    ``VLM_CATALOG_KERNELS_OFF`` names ``fp8_float16_dots``."""
    return (cache_dtype == torch.float8_e4m3fn and query_dtype in (torch.bfloat16, torch.float16)
            and "fp8_float16_dots" not in kernels_off())


@functools.cache
def _cuda_multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """SMs on a CUDA device; a small stand-in for CPU tensors (Triton interpreter)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_multiprocessor_count(index)
    return 4
