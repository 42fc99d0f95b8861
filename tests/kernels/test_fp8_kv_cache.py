"""An FP8 (e4m3) paged KV cache: writing rounds and saturates, readers widen to the query's dtype.

References: the write is checked bit for bit against `to_cache_dtype` (clamp to
+-448, round to e4m3); attention over an FP8 cache is checked against the same
attention over that cache widened to the query's dtype, so the only error left
is the kernel's own (TOLERANCE[query dtype]). The error FP8 storage adds over a
bf16 cache is measured separately, with its bound written down.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.fp8 import FP8_DTYPE
from kernels.kv_cache import (
    FP8_MAX,
    reshape_and_cache_reference,
    reshape_and_cache_triton,
    to_cache_dtype,
)
from kernels.paged_decode_attention import (
    paged_decode_attention_reference,
    paged_decode_attention_triton,
    paged_decode_attention_with_kv_write_reference,
    paged_decode_attention_with_kv_write_triton,
    reads_fp8_words,
)
from kernels.paged_prefill_attention import (
    paged_prefill_attention_reference,
    paged_prefill_attention_triton,
)
from tests.kernels.helpers import TOLERANCE, assert_close
from tests.kernels.paged import build_paged_kv


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """FP8 payload as bytes: exact comparison, NaN patterns included."""
    return tensor.cpu().view(torch.uint8)


def _widened(paged, dtype):
    return paged.k_cache.to(dtype), paged.v_cache.to(dtype)


# --------------------------------------------------------------------------- writing
def test_to_cache_dtype_saturates_instead_of_overflowing():
    values = torch.tensor([0.0, 1.0, -3.3, 447.0, 448.0, 500.0, -1e6, 1e-3])
    stored = to_cache_dtype(values, FP8_DTYPE).float()
    assert stored.tolist()[:5] == [0.0, 1.0, -3.25, 448.0, 448.0]  # e4m3: 3 mantissa bits
    assert stored[5] == FP8_MAX and stored[6] == -FP8_MAX, "out-of-range values saturate"
    assert torch.isfinite(stored).all()
    # the rounding error of e4m3 in its normal range: at most half a unit of the 3-bit mantissa
    normal = torch.linspace(-400, 400, 1001)
    normal = normal[normal.abs() > 2**-6]
    relative = ((to_cache_dtype(normal, FP8_DTYPE).float() - normal).abs() / normal.abs()).max()
    assert relative <= 2**-4


def test_reference_write_stores_rounded_values():
    k_cache = torch.zeros(3, 4, 2, 8, dtype=FP8_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(5, 2, 8) * 300, torch.randn(5, 2, 8)
    slots = torch.tensor([0, 5, -1, 11, 2])
    reshape_and_cache_reference(k, v, k_cache, v_cache, slots)
    flat_k = k_cache.view(-1, 2, 8)  # [slots, Hkv, D]
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(_bits(flat_k[slot]), _bits(to_cache_dtype(k[token], FP8_DTYPE)))


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_triton_write_matches_reference_bit_for_bit(triton_device, input_dtype):
    num_blocks, block_size, num_kv_heads, head_dim = 6, 4, 2, 32
    k = (torch.randn(9, num_kv_heads, head_dim) * 200).to(input_dtype).to(triton_device)  # some beyond 448
    v = torch.randn(9, num_kv_heads, head_dim).to(input_dtype).to(triton_device)
    slots = torch.randperm(num_blocks * block_size)[:9]
    slots[3] = -1
    slots = slots.to(triton_device)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), device=triton_device)
    k_cache = k_cache.to(FP8_DTYPE)
    v_cache = k_cache.clone()
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reshape_and_cache_triton(k, v, k_cache, v_cache, slots)
    reshape_and_cache_reference(k, v, expected_k, expected_v, slots)
    assert torch.equal(_bits(k_cache), _bits(expected_k)) and torch.equal(_bits(v_cache), _bits(expected_v))


# --------------------------------------------------------------------------- decode
DECODE_CASES = [
    # (context lengths, block size, Hq, Hkv, head_dim, num_splits)
    ([1, 17, 40, 0], 4, 4, 4, 32, None),
    ([130, 7], 4, 8, 2, 32, 3),
    ([70], 16, 32, 4, 128, 2),  # model head dim and GQA ratio 8
    ([13, 40], 4, 4, 2, 6, 2),  # a head dim that is not a whole number of words: V read as bytes
]


def test_fp8_v_cache_is_read_as_words_only_where_rows_are_word_aligned():
    cache = torch.zeros(4, 16, 2, 8, dtype=FP8_DTYPE)  # [blocks, block_size, Hkv, D]
    assert reads_fp8_words(cache)
    assert not reads_fp8_words(torch.zeros(4, 16, 2, 6, dtype=FP8_DTYPE))  # rows of 6 bytes
    assert not reads_fp8_words(cache[..., 2:6])  # rows that start 2 bytes into a word
    assert not reads_fp8_words(cache.transpose(1, 3))  # a head dim that is not the innermost


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context_lens,block_size,num_q_heads,num_kv_heads,head_dim,num_splits", DECODE_CASES)
def test_triton_decode_over_fp8_cache(
    triton_device, query_dtype, context_lens, block_size, num_q_heads, num_kv_heads, head_dim, num_splits
):
    # tolerance: TOLERANCE[query dtype] against the reference on the widened cache
    paged = build_paged_kv(context_lens, block_size, num_kv_heads, head_dim, FP8_DTYPE, triton_device)
    q = torch.randn(len(context_lens), num_q_heads, head_dim).to(query_dtype).to(triton_device)
    scale = head_dim**-0.5
    out = paged_decode_attention_triton(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, scale, num_splits=num_splits
    )
    k_wide, v_wide = _widened(paged, query_dtype)
    expected = paged_decode_attention_reference(q, k_wide, v_wide, paged.block_tables, paged.context_lens, scale)
    assert out.dtype == query_dtype
    assert_close(out, expected, rel=TOLERANCE[query_dtype])


@pytest.mark.parametrize("query_scale", [300.0, 1e-4])
def test_triton_decode_over_fp8_cache_with_large_and_tiny_bf16_queries(triton_device, query_scale):
    """A bf16 query over an FP8 cache runs both dots in float16: large queries (scores in the
    thousands: a one-hot softmax) and tiny ones (many below float16's smallest normal, 6e-5:
    a flat softmax) still match the reference."""
    # tolerance: TOLERANCE[bfloat16] against the reference on the widened cache. The interpreter
    # rounds a float16 dot's running sum to float16 (the GPU accumulates in float32), so scores
    # stay below float16's largest value here.
    assert_bf16_decode_over_fp8_cache_matches([70, 9], 16, 32, 4, 128, triton_device, query_scale)


def assert_bf16_decode_over_fp8_cache_matches(context_lens, block_size, num_q_heads, num_kv_heads, head_dim,
                                              device, query_scale: float = 1.0) -> None:
    """A bf16 query over an FP8 cache, in two splits, against the reference on the widened cache
    (TOLERANCE[bfloat16])."""
    paged = build_paged_kv(context_lens, block_size, num_kv_heads, head_dim, FP8_DTYPE, device)
    q = (torch.randn(len(context_lens), num_q_heads, head_dim) * query_scale).to(torch.bfloat16).to(device)
    scale = head_dim**-0.5
    out = paged_decode_attention_triton(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, scale, num_splits=2
    )
    k_wide, v_wide = _widened(paged, torch.bfloat16)
    expected = paged_decode_attention_reference(q, k_wide, v_wide, paged.block_tables, paged.context_lens, scale)
    assert_close(out, expected, rel=TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("turned_off", ["fp8_v_words", "fp8_float16_dots", "fp8_v_words,fp8_float16_dots"])
def test_triton_decode_over_fp8_cache_without_its_fast_paths(triton_device, monkeypatch, turned_off):
    """V read as bytes (`fp8_v_words` off) and both dots in bf16 (`fp8_float16_dots` off: the
    query's dtype), the two ways the kernel ran before, for timing them apart on a GPU: the
    same answers. Tolerance: TOLERANCE[bfloat16] against the reference on the widened cache."""
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", turned_off)
    assert_bf16_decode_over_fp8_cache_matches([70, 9, 33], 16, 8, 2, 64, triton_device)


def test_reference_decode_over_fp8_cache_equals_the_widened_cache():
    # the CPU path widens to float32 itself: exactly the same numbers
    paged = build_paged_kv([5, 33, 0], 4, 2, 16, FP8_DTYPE, torch.device("cpu"))
    q = torch.randn(3, 4, 16)
    args = (paged.block_tables, paged.context_lens, 0.25)
    torch.testing.assert_close(
        kernels.paged_decode_attention(q, paged.k_cache, paged.v_cache, *args),
        paged_decode_attention_reference(q, *_widened(paged, torch.float32), *args),
        rtol=0, atol=0,
    )


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_fused_write_rounds_like_the_separate_write(triton_device, num_splits):
    block_size, num_q_heads, num_kv_heads, head_dim = 4, 8, 2, 32
    context_lens = [9, 0, 30]
    paged = build_paged_kv(context_lens, block_size, num_kv_heads, head_dim, FP8_DTYPE, triton_device)
    slots = []
    for seq, length in enumerate(context_lens):  # the current token is the last context position
        if length == 0:
            slots.append(-1)
            continue
        block = int(paged.block_tables[seq, (length - 1) // block_size])
        slots.append(block * block_size + (length - 1) % block_size)
    slots = torch.tensor(slots, device=triton_device)
    q = torch.randn(3, num_q_heads, head_dim).to(torch.bfloat16).to(triton_device)
    k = (torch.randn(3, num_kv_heads, head_dim) * 100).to(torch.bfloat16).to(triton_device)
    v = torch.randn(3, num_kv_heads, head_dim).to(torch.bfloat16).to(triton_device)
    expected_k, expected_v = paged.k_cache.clone(), paged.v_cache.clone()
    expected = paged_decode_attention_with_kv_write_reference(
        q, k, v, expected_k, expected_v, slots, paged.block_tables, paged.context_lens, head_dim**-0.5
    )
    out = paged_decode_attention_with_kv_write_triton(
        q, k, v, paged.k_cache, paged.v_cache, slots, paged.block_tables, paged.context_lens, head_dim**-0.5,
        num_splits=num_splits,
    )
    assert torch.equal(_bits(paged.k_cache), _bits(expected_k)) and torch.equal(_bits(paged.v_cache), _bits(expected_v))
    assert_close(out, expected, rel=TOLERANCE[torch.bfloat16])


# --------------------------------------------------------------------------- prefill
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_triton_prefill_over_fp8_cache(triton_device, query_dtype):
    # tolerance: TOLERANCE[query dtype] against the reference on the widened cache
    context_lens, query_lens = [40, 7, 70], [40, 3, 20]  # a whole prompt, two chunks after a cached prefix
    num_q_heads, num_kv_heads, head_dim = 8, 2, 32
    paged = build_paged_kv(context_lens, 16, num_kv_heads, head_dim, FP8_DTYPE, triton_device)
    q = torch.randn(sum(query_lens), num_q_heads, head_dim).to(query_dtype).to(triton_device)
    cu_seqlens = torch.tensor([0, 40, 43, 63], dtype=torch.int32, device=triton_device)
    args = (paged.block_tables, cu_seqlens, paged.context_lens, head_dim**-0.5)
    out = paged_prefill_attention_triton(q, paged.k_cache, paged.v_cache, *args)
    expected = paged_prefill_attention_reference(q, *_widened(paged, query_dtype), *args)
    assert_close(out, expected, rel=TOLERANCE[query_dtype])
    # the CPU path takes the FP8 cache too
    assert_close(paged_prefill_attention_reference(q, paged.k_cache, paged.v_cache, *args), expected,
                 rel=TOLERANCE[query_dtype])


# --------------------------------------------------------------------------- what FP8 storage costs
def test_fp8_storage_error_against_a_bf16_cache():
    """Decode over the same K/V stored in bf16 and in FP8, unit-variance K/V at head dim 128.

    e4m3 rounds each element by up to 1/16 (about 1/32 on average). The FP8 cache moves
    the output by 3.5-3.8% in relative L2 norm over five seeds; the bound is 5%."""
    context_lens, num_q_heads, num_kv_heads, head_dim = [300, 64, 1000], 32, 4, 128
    paged = build_paged_kv(context_lens, 16, num_kv_heads, head_dim, torch.bfloat16, torch.device("cpu"))
    q = torch.randn(3, num_q_heads, head_dim).to(torch.bfloat16)
    args = (paged.block_tables, paged.context_lens, head_dim**-0.5)
    bf16_out = paged_decode_attention_reference(q, paged.k_cache, paged.v_cache, *args)
    fp8_out = paged_decode_attention_reference(
        q, to_cache_dtype(paged.k_cache, FP8_DTYPE), to_cache_dtype(paged.v_cache, FP8_DTYPE), *args
    )
    relative_l2 = ((fp8_out.float() - bf16_out.float()).norm() / bf16_out.float().norm()).item()
    assert 0 < relative_l2 < 5e-2


def test_query_dtype_must_match_a_non_fp8_cache(triton_device):
    paged = build_paged_kv([5], 4, 2, 16, torch.bfloat16, triton_device)
    q = torch.randn(1, 4, 16, device=triton_device)  # float32 against a bf16 cache
    with pytest.raises(ValueError, match="q: dtype"):
        paged_decode_attention_triton(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 0.25)


@pytest.mark.gpu
def test_gpu_fp8_decode_and_prefill_model_shapes(cuda_device):
    # tolerance: bf16 (1e-2) against the reference on the widened cache
    num_q_heads, num_kv_heads, head_dim = 32, 4, 128
    paged = build_paged_kv([4000, 900, 27000], 16, num_kv_heads, head_dim, FP8_DTYPE, cuda_device)
    scale = head_dim**-0.5
    k_wide, v_wide = _widened(paged, torch.bfloat16)
    q = torch.randn(3, num_q_heads, head_dim, device=cuda_device, dtype=torch.bfloat16)
    decode_args = (paged.block_tables, paged.context_lens, scale)
    assert_close(kernels.paged_decode_attention(q, paged.k_cache, paged.v_cache, *decode_args),
                 paged_decode_attention_reference(q, k_wide, v_wide, *decode_args), rel=TOLERANCE[torch.bfloat16])
    chunk = torch.randn(3 * 512, num_q_heads, head_dim, device=cuda_device, dtype=torch.bfloat16)
    cu_seqlens = torch.arange(0, 4 * 512, 512, dtype=torch.int32, device=cuda_device)
    prefill_args = (paged.block_tables, cu_seqlens, paged.context_lens, scale)
    assert_close(kernels.paged_prefill_attention(chunk, paged.k_cache, paged.v_cache, *prefill_args),
                 paged_prefill_attention_reference(chunk, k_wide, v_wide, *prefill_args), rel=TOLERANCE[torch.bfloat16])
