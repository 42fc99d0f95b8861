"""Scatter new K/V tokens into the paged cache; one program per token."""

import triton
import triton.language as tl

from kernels.jit.fp8_quant import saturate_fp8
from kernels.jit.pdl import after_previous_grid


@triton.jit
def reshape_and_cache_kernel(
    # pointers
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_mapping_ptr,  # [T]; negative = padding, skipped; >= num_slots (a caller's bug) skipped too
    # sizes
    num_kv_heads,
    block_size,
    num_slots,  # num_blocks * block_size
    # strides
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_k_cache_block,
    stride_k_cache_offset,
    stride_k_cache_head,
    stride_v_cache_block,
    stride_v_cache_offset,
    stride_v_cache_head,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SATURATE_FP8: tl.constexpr,  # the cache is float8 e4m3: clamp to +-448 before rounding
):
    after_previous_grid()  # first, before any memory access (kernels/pdl.py)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):  # never a write outside the cache
        return
    block = slot // block_size
    offset = slot % block_size

    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < HEAD_DIM)  # [BLOCK_HEADS, BLOCK_D]

    key = tl.load(k_ptr + token * stride_k_token + heads * stride_k_head + dims, mask=mask)
    value = tl.load(v_ptr + token * stride_v_token + heads * stride_v_head + dims, mask=mask)
    if SATURATE_FP8:
        key = saturate_fp8(key)
        value = saturate_fp8(value)
    k_slot = k_cache_ptr + block * stride_k_cache_block + offset * stride_k_cache_offset
    v_slot = v_cache_ptr + block * stride_v_cache_block + offset * stride_v_cache_offset
    tl.store(
        k_slot + heads * stride_k_cache_head + dims, key.to(k_cache_ptr.dtype.element_ty), mask=mask
    )
    tl.store(
        v_slot + heads * stride_v_cache_head + dims,
        value.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )
