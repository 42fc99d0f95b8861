"""Paged KV cache: writing new tokens into it, and helpers to read it back.

Shape (fixed): per layer, ``k_cache`` and ``v_cache`` of shape
``[num_blocks, block_size, Hkv, D]``. Token slot ``slot = block_id * block_size +
offset``; sequence b's i-th token lives in block ``block_tables[b, i // block_size]``
at offset ``i % block_size``. A negative slot marks a padding token (skipped).

Memory layout (`VLM_CATALOG_KV_LAYOUT`, `zeros_paged_cache`): ``interleaved``, the default,
is that shape contiguous, so within a page each token's Hkv heads lie together. ``head_major``
keeps each page as ``[Hkv, block_size, D]`` in memory, seen through the same shape: the rows
of one KV head, which one decode program reads, lie together (vLLM's first paged layout did
this). Every kernel reads and writes the caches through their strides, and the readers here
never flatten a head-major pool (that would copy it whole); bench_kernels.py times the decode
kernel on both (`paged_decode_attention[fp8 kv, head-major pages]`).

The cache holds the model's dtype, or FP8 e4m3 (`torch.float8_e4m3fn`) at half
the bytes of bf16. FP8 is stored without a scale (scale 1.0, as vLLM's FP8
cache does when the checkpoint brings no calibrated scales): new K/V are
rounded to e4m3 and saturate at +-448, and readers convert back to the query's
dtype. Qwen3's per-head q/k norms keep K well inside that range.
"""

from __future__ import annotations

import torch

from kernels.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    KV_CACHE_DTYPES,
    check_dtype,
    check_same_device,
    check_shape,
    check_unit_stride_last_dim,
)
from kernels.dispatch import environment_choice, use_triton
from kernels.fp8 import FP8_DTYPE, FP8_MAX
from kernels.launch_math import next_power_of_2
from kernels.pdl import launch_options

KV_LAYOUT_ENV_VAR = "VLM_CATALOG_KV_LAYOUT"
KV_LAYOUTS = ("interleaved", "head_major")  # the first is the default


def kv_layout() -> str:
    """The paged caches' memory layout `VLM_CATALOG_KV_LAYOUT` asks for (module docstring)."""
    return environment_choice(KV_LAYOUT_ENV_VAR, KV_LAYOUTS)


def zeros_paged_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: torch.device | str, layout: str | None = None) -> torch.Tensor:
    """A zeroed pool [num_blocks, block_size, Hkv, D] in `layout` (default: `kv_layout()`)."""
    layout = layout or kv_layout()
    if layout not in KV_LAYOUTS:
        raise ValueError(f"layout: {layout!r} is not one of {', '.join(KV_LAYOUTS)}")
    if layout == "head_major":
        pages = torch.zeros((num_blocks, num_kv_heads, block_size, head_dim), dtype=dtype, device=device)
        return pages.transpose(1, 2)  # [N, Hkv, bs, D] in memory -> the [N, bs, Hkv, D] view
    return torch.zeros((num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)


def check_paged_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validates a layer's cache pair; returns (num_blocks, block_size, Hkv, D)."""
    check_shape("k_cache", k_cache, (None, None, None, None))
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_dtype("k_cache", k_cache, KV_CACHE_DTYPES)
    check_dtype("v_cache", v_cache, (k_cache.dtype,))
    check_unit_stride_last_dim("k_cache", k_cache)
    check_unit_stride_last_dim("v_cache", v_cache)
    check_same_device(k_cache=k_cache, v_cache=v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim


def check_query_matches_cache(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Queries are in the model's dtype; the cache holds that dtype or FP8."""
    allowed = (k_cache.dtype,) if k_cache.dtype != FP8_DTYPE else FLOAT_DTYPES
    check_dtype("q", q, allowed)


def to_cache_dtype(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` as stored in a cache of `dtype`; FP8 saturates at +-FP8_MAX instead of
    relying on the cast's overflow behaviour."""
    if dtype == FP8_DTYPE:
        values = values.clamp(-FP8_MAX, FP8_MAX)
    return values.to(dtype)


def gather_sequence_kv(
    cache: torch.Tensor, block_table_row: torch.Tensor, length: int
) -> torch.Tensor:
    """The first `length` tokens of one sequence: cache [N, bs, Hkv, D] -> [length, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = block_table_row[:num_blocks].long()
    return cache[blocks].flatten(0, 1)[:length]  # [num_blocks * bs, Hkv, D] -> [length, Hkv, D]


class PackedContexts:
    """Every sequence's whole context (its first `context_lens[b]` cached tokens) read out of a
    paged cache and packed: sequence b's keys are rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``.

    The cache slots are computed on the device on first use, without a sync (the lengths are
    also known on the host), and then serve every layer of a step: build one per step.
    """

    def __init__(self, block_tables: torch.Tensor, context_lens: torch.Tensor, host_context_lens: list[int]):
        self.block_tables = block_tables  # [B, max_blocks] int32
        self.context_lens = context_lens  # [B] int32, on the device
        self.total = sum(host_context_lens)
        self.max_len = max(host_context_lens, default=0)
        self._slots: torch.Tensor | None = None
        self._cu_seqlens_k: torch.Tensor | None = None

    def layout(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots [total] int64, cu_seqlens_k [B+1] int32) for caches of `block_size` (every layer's
        is the same: computed on the first call)."""
        if self._slots is None:
            device = self.block_tables.device
            lengths = self.context_lens.long()
            ends = lengths.cumsum(0)  # [B]
            self._cu_seqlens_k = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)  # [B + 1]
            sequence = torch.repeat_interleave(
                torch.arange(lengths.shape[0], device=device), lengths, output_size=self.total
            )  # [total]: the sequence of each key
            position = torch.arange(self.total, device=device) - (ends - lengths)[sequence]  # [total]
            blocks = self.block_tables[sequence, torch.div(position, block_size, rounding_mode="floor")]
            self._slots = blocks.long() * block_size + position % block_size
        return self._slots, self._cu_seqlens_k

    def gather(self, cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """cache [N, bs, Hkv, D] (either layout) -> the packed contexts [total, Hkv, D] in `dtype`."""
        block_size = cache.shape[1]
        slots, _ = self.layout(block_size)
        # FP8: gathered as its bytes (index kernels need not take float8)
        source = cache.view(torch.uint8) if cache.element_size() == 1 else cache
        if source.is_contiguous():
            rows = source.flatten(0, 1).index_select(0, slots)  # [N * bs, Hkv, D] -> [total, Hkv, D]
        else:  # head-major pages, which flatten would copy whole: by (block, offset)
            rows = source[torch.div(slots, block_size, rounding_mode="floor"), slots % block_size]  # [total, Hkv, D]
        return (rows.view(cache.dtype) if source is not cache else rows).to(dtype)


# --------------------------------------------------------------------------- reference
def reshape_and_cache_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes k/v [T, Hkv, D] into the caches at `slot_mapping` [T] (negative = skip)."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = to_cache_dtype(k[valid], k_cache.dtype)
    v_cache[blocks, offsets] = to_cache_dtype(v[valid], v_cache.dtype)


# --------------------------------------------------------------------------- triton
def check_reshape_and_cache_args(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    _, _, num_kv_heads, head_dim = check_paged_kv_cache(k_cache, v_cache)
    check_shape("k", k, (None, num_kv_heads, head_dim))
    check_shape("v", v, tuple(k.shape))
    check_shape("slot_mapping", slot_mapping, (k.shape[0],))
    check_dtype("k", k, FLOAT_DTYPES)
    check_dtype("v", v, FLOAT_DTYPES)
    check_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
    check_unit_stride_last_dim("k", k)
    check_unit_stride_last_dim("v", v)
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)


def reshape_and_cache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    from kernels.jit.kv_cache import reshape_and_cache_kernel

    check_reshape_and_cache_args(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    reshape_and_cache_kernel[(num_tokens,)](
        # pointers
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        # sizes
        num_kv_heads,
        k_cache.shape[1],
        k_cache.shape[0] * k_cache.shape[1],
        # strides
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        # meta-parameters
        HEAD_DIM=head_dim,
        BLOCK_HEADS=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        SATURATE_FP8=k_cache.dtype == FP8_DTYPE,
        num_warps=4,
        **launch_options(k),
    )


# --------------------------------------------------------------------------- dispatch
def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """In place: token t of k/v [T, Hkv, D] goes to slot `slot_mapping[t]` (skipped when < 0).
    A slot past the cache is an `IndexError` in the reference; the kernel, which cannot raise
    without a host sync, skips it rather than write outside the cache."""
    if use_triton(k, v, k_cache, v_cache, slot_mapping, op="reshape_and_cache"):
        reshape_and_cache_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        reshape_and_cache_reference(k, v, k_cache, v_cache, slot_mapping)
