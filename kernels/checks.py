"""Argument checks shared by the Triton wrappers.

Each helper raises a `ValueError` whose message names the argument and what is
wrong with it, so a caller sees "k_cache: expected 4 dimensions, got 3" rather
than an out-of-bounds read inside a kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.fp8 import FP8_DTYPE

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
# the paged KV cache may also hold FP8 (e4m3): half the bytes of bf16 per token
KV_CACHE_DTYPES = FLOAT_DTYPES + (FP8_DTYPE,)


def check_shape(name: str, tensor: torch.Tensor, expected: Sequence[int | None]) -> None:
    """`tensor` has len(expected) dims; each int entry must match (None = any size)."""
    if tensor.dim() != len(expected):
        raise ValueError(
            f"{name}: expected {len(expected)} dimensions, got {tensor.dim()} "
            f"(shape {tuple(tensor.shape)})"
        )
    for axis, (actual, wanted) in enumerate(zip(tensor.shape, expected)):
        if wanted is not None and actual != wanted:
            shown = tuple("*" if w is None else w for w in expected)
            raise ValueError(
                f"{name}: expected shape {shown}, got {tuple(tensor.shape)} "
                f"(mismatch at dim {axis})"
            )


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (messages, and the keys of the launch-settings tables)."""
    return str(dtype).removeprefix("torch.")


def check_dtype(name: str, tensor: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(dtype_name(d) for d in allowed)
        raise ValueError(f"{name}: dtype {tensor.dtype} is not supported (expected one of {names})")


def check_same_dtype(**tensors: torch.Tensor) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"dtype mismatch: {dtypes}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors are on different devices: {devices}")


def check_unit_stride_last_dim(name: str, tensor: torch.Tensor) -> None:
    """Kernels load rows as contiguous vectors; other strides are free."""
    if tensor.dim() > 0 and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(
            f"{name}: the last dimension must be contiguous (stride 1), "
            f"got strides {tensor.stride()}"
        )


def check_contiguous(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{name}: must be contiguous, got strides {tensor.stride()}")


def check_block_scales(name: str, scale: torch.Tensor, weight_shape: tuple[int, int], block: tuple[int, int],
                       leading: tuple[int, ...] = ()) -> None:
    """`scale` holds one float32 per `block` of a [rows, cols] weight (after `leading` dims,
    e.g. the experts); the message names the argument."""
    block_n, block_k = block
    if block_n < 1 or block_k < 1:
        raise ValueError(f"block must be two positive sizes, got {tuple(block)}")
    rows, cols = weight_shape
    check_shape(name, scale, (*leading, -(-rows // block_n), -(-cols // block_k)))
    check_dtype(name, scale, (torch.float32,))
