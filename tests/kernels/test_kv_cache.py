"""reshape_and_cache: reference semantics, Triton vs reference (padding slots, block sizes)."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.kv_cache import (
    gather_sequence_kv,
    reshape_and_cache_reference,
    reshape_and_cache_triton,
)


def test_reference_writes_each_token_to_its_slot_and_skips_padding():
    num_blocks, block_size, num_kv_heads, head_dim = 4, 3, 2, 8
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(4, num_kv_heads, head_dim), torch.randn(4, num_kv_heads, head_dim)
    slots = torch.tensor([7, -1, 0, 11])
    reshape_and_cache_reference(k, v, k_cache, v_cache, slots)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)  # [slots, Hkv, D]
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], k[token]) and torch.equal(flat_v[slot], v[token])
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[[7, 0, 11]] = True
    assert flat_k[~written].abs().sum() == 0 and flat_v[~written].abs().sum() == 0


def test_gather_sequence_kv_follows_the_block_table():
    cache = torch.arange(5 * 2 * 1 * 1, dtype=torch.float32).view(
        5, 2, 1, 1
    )  # slot value == slot id
    table = torch.tensor([3, 0, 4], dtype=torch.int32)
    gathered = gather_sequence_kv(cache, table, 5)  # positions 0..4 -> blocks 3, 3, 0, 0, 4
    assert gathered.flatten().tolist() == [6, 7, 0, 1, 8]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "block_size,num_kv_heads,head_dim", [(1, 1, 8), (4, 2, 32), (16, 4, 128), (5, 3, 24)]
)
def test_triton_reshape_and_cache(triton_device, cache_dtype, block_size, num_kv_heads, head_dim):
    # exact: a copy (with a cast to the cache dtype)
    num_blocks, num_tokens = 12, 9
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=triton_device).to(cache_dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, device=triton_device).to(cache_dtype)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[1, 5]] = -1  # padding tokens
    slots = slots.to(triton_device)
    # caches poisoned with NaN: untouched slots must stay NaN, written ones must equal k/v
    k_cache = torch.full(
        (num_blocks, block_size, num_kv_heads, head_dim),
        float("nan"),
        dtype=cache_dtype,
        device=triton_device,
    )
    v_cache = k_cache.clone()
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    kernels.reshape_and_cache(k, v, k_cache, v_cache, slots)
    reshape_and_cache_reference(k, v, expected_k, expected_v, slots)
    torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0, equal_nan=True)


def test_triton_casts_to_cache_dtype_and_accepts_strided_inputs(triton_device):
    qkv = torch.randn(5, 3, 2, 16, device=triton_device)  # [T, q/k/v, Hkv, D]
    k, v = qkv[:, 1], qkv[:, 2]  # strided views
    k_cache = torch.zeros(3, 2, 2, 16, dtype=torch.bfloat16, device=triton_device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([0, 1, 2, 3, 4], device=triton_device)
    reshape_and_cache_triton(k, v, k_cache, v_cache, slots)
    flat = k_cache.view(-1, 2, 16)[:5]  # [slots, Hkv, D]
    torch.testing.assert_close(flat, k.to(torch.bfloat16), rtol=0, atol=0)


def test_triton_skips_slots_past_the_cache(triton_device):
    # the caches are the first 3 blocks of a 4-block buffer: slot 12 would land in block 3, outside
    # them (on a GPU, a write into other memory); the reference raises, the kernel skips it
    k = torch.randn(3, 2, 16, device=triton_device)
    buffers = [torch.zeros(4, 4, 2, 16, device=triton_device) for _ in range(2)]
    k_cache, v_cache = (buffer[:3] for buffer in buffers)
    slots = torch.tensor([12, 0, 2**40], device=triton_device)
    reshape_and_cache_triton(k, k, k_cache, v_cache, slots)
    for buffer in buffers:
        assert torch.equal(buffer[0, 0], k[1])
        assert buffer[3].abs().sum() == 0 and buffer.view(-1, 2, 16)[1:].abs().sum() == 0
    with pytest.raises(IndexError):
        reshape_and_cache_reference(k, k, k_cache, v_cache, slots)


def test_triton_rejects_bad_arguments(triton_device):
    k = torch.randn(3, 2, 16, device=triton_device)
    cache = torch.zeros(4, 4, 2, 16, device=triton_device)
    slots = torch.zeros(3, dtype=torch.long, device=triton_device)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache_triton(k, k, cache, cache.clone(), slots[:2])
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache_triton(k, k, cache, cache.clone(), slots.float())
    with pytest.raises(ValueError, match="k"):
        reshape_and_cache_triton(
            torch.randn(3, 4, 16, device=triton_device), k, cache, cache.clone(), slots
        )
    with pytest.raises(ValueError, match="v_cache"):
        reshape_and_cache_triton(k, k, cache, cache[:, :2].clone(), slots)


@pytest.mark.gpu
def test_gpu_reshape_and_cache(cuda_device):
    num_blocks, block_size = 2048, 16
    k = torch.randn(8192, 4, 128, device=cuda_device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * block_size, device=cuda_device)[:8192]
    slots[::7] = -1
    k_cache = torch.zeros(num_blocks, block_size, 4, 128, device=cuda_device, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    kernels.reshape_and_cache(k, v, k_cache, v_cache, slots)
    reshape_and_cache_reference(k, v, expected_k, expected_v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
