"""paged_prefill_attention: reference vs float64 dense causal attention with a cached
prefix; consistency with decode; Triton vs reference."""

from __future__ import annotations

import importlib

import pytest
import torch

import kernels
from kernels.flash_varlen import flash_varlen_usable
from kernels.fp8 import FP8_DTYPE
from kernels.kv_cache import PackedContexts, to_cache_dtype
from kernels.paged_decode_attention import paged_decode_attention_reference
from kernels.paged_prefill_attention import (
    NEVER,
    PREFILL_BACKEND_ENV_VAR,
    SDPA_MIN_PREFILL_LEN,
    paged_prefill_attention_per_sequence,
    paged_prefill_attention_reference,
    paged_prefill_attention_triton,
    sdpa_min_prefill_len,
)
from tests.kernels.flash_fakes import FakeFlashVarlen, FakeFlashVarlenIsCausal
from tests.kernels.helpers import TOLERANCE, assert_close
from tests.kernels.paged import build_paged_kv, dense_attention_float64

prefill_module = importlib.import_module("kernels.paged_prefill_attention")  # `kernels` exports a same-named function


def packed_queries(query_lens: list[int], num_q_heads: int, head_dim: int, dtype, device):
    cu_seqlens = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_seqlens[-1]), num_q_heads, head_dim).to(dtype).to(device)
    return q, cu_seqlens.to(device)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_reference_against_float64_dense_causal(num_q_heads, num_kv_heads):
    # tolerance: 1e-5 relative (float32)
    head_dim, scale = 16, 0.3
    query_lens, context_lens = (
        [5, 3, 0, 1],
        [5, 20, 7, 12],
    )  # fresh prompt, chunk after a prefix, none, decode-like
    paged = build_paged_kv(
        context_lens, 4, num_kv_heads, head_dim, torch.float32, torch.device("cpu")
    )
    q, cu_seqlens = packed_queries(query_lens, num_q_heads, head_dim, torch.float32, "cpu")
    out = paged_prefill_attention_reference(
        q, paged.k_cache, paged.v_cache, paged.block_tables, cu_seqlens, paged.context_lens, scale
    )
    for seq, (query_len, context_len) in enumerate(zip(query_lens, context_lens)):
        if query_len == 0:
            continue
        begin = int(cu_seqlens[seq])
        positions = torch.arange(context_len - query_len, context_len)
        expected = dense_attention_float64(
            q[begin : begin + query_len],
            paged.dense_k[seq],
            paged.dense_v[seq],
            scale,
            query_positions=positions,
        )
        assert_close(out[begin : begin + query_len], expected, rel=1e-5, what=f"sequence {seq}")


@pytest.mark.parametrize("max_side", [4096, 8])  # 8: contexts past the cached mask get their own
def test_lower_right_causal_mask_is_the_chunk_corner_of_a_causal_mask(monkeypatch, max_side):
    monkeypatch.setattr(prefill_module, "MAX_CACHED_MASK_SIDE", max_side)
    monkeypatch.setattr(prefill_module, "_causal_masks", {})
    for query_len, context_len in [(3, 7), (1, 1), (5, 5), (2, 1500), (7, 9), (1500, 1500)]:
        mask = prefill_module._lower_right_causal_mask(query_len, context_len, torch.float32, torch.device("cpu"))
        positions = torch.arange(context_len - query_len, context_len)
        visible = torch.arange(context_len)[None, :] <= positions[:, None]  # [q_len, L]
        assert mask.shape == (query_len, context_len)
        assert torch.equal(mask == 0, visible) and bool(torch.isneginf(mask[~visible]).all())


def test_single_query_prefill_equals_decode():
    paged = build_paged_kv([9, 17], 4, 2, 16, torch.float32, torch.device("cpu"))
    q = torch.randn(2, 8, 16)
    cu_seqlens = torch.tensor([0, 1, 2], dtype=torch.int32)
    prefill = paged_prefill_attention_reference(
        q, paged.k_cache, paged.v_cache, paged.block_tables, cu_seqlens, paged.context_lens, 0.25
    )
    decode = paged_decode_attention_reference(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 0.25
    )
    assert_close(prefill, decode, rel=1e-6)


CASES = [
    # (query lengths, context lengths, block size, Hq, Hkv, head_dim)
    (
        [5, 3, 0, 1],
        [5, 20, 7, 33],
        4,
        4,
        4,
        32,
    ),  # GQA 1: fresh, chunk after prefix, no queries, decode-like
    ([70, 2], [90, 2], 16, 8, 2, 32),  # GQA 4: query tiles of 64 and a long prefix
    ([6, 11], [6, 30], 1, 8, 2, 16),  # block size 1
    ([9], [25], 5, 6, 3, 24),  # odd block size / head dim
    ([4], [19], 16, 32, 4, 128),  # model head dim, GQA 8
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "query_lens,context_lens,block_size,num_q_heads,num_kv_heads,head_dim", CASES
)
def test_triton_paged_prefill(
    triton_device,
    poison_allocations,
    dtype,
    query_lens,
    context_lens,
    block_size,
    num_q_heads,
    num_kv_heads,
    head_dim,
):
    # tolerance: TOLERANCE[dtype] (float32 1e-4, 16-bit 1e-2), max-norm relative
    paged = build_paged_kv(context_lens, block_size, num_kv_heads, head_dim, dtype, triton_device)
    q, cu_seqlens = packed_queries(query_lens, num_q_heads, head_dim, dtype, triton_device)
    args = (
        q,
        paged.k_cache,
        paged.v_cache,
        paged.block_tables,
        cu_seqlens,
        paged.context_lens,
        head_dim**-0.5,
    )
    out = kernels.paged_prefill_attention(*args)
    assert_close(out, paged_prefill_attention_reference(*args), rel=TOLERANCE[dtype])


def test_triton_with_max_query_len_hint(triton_device):
    paged = build_paged_kv([12, 8], 4, 2, 16, torch.float32, triton_device)
    q, cu_seqlens = packed_queries([12, 3], 4, 16, torch.float32, triton_device)
    args = (
        q,
        paged.k_cache,
        paged.v_cache,
        paged.block_tables,
        cu_seqlens,
        paged.context_lens,
        0.25,
    )
    assert_close(
        paged_prefill_attention_triton(*args, max_query_len=12),
        paged_prefill_attention_reference(*args),
        rel=1e-4,
    )


def test_triton_rejects_bad_arguments(triton_device):
    paged = build_paged_kv([5, 3], 4, 2, 16, torch.float32, triton_device)
    q, cu_seqlens = packed_queries([5, 3], 4, 16, torch.float32, triton_device)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_prefill_attention_triton(
            q,
            paged.k_cache,
            paged.v_cache,
            paged.block_tables,
            cu_seqlens[:2],
            paged.context_lens,
            0.3,
        )
    with pytest.raises(ValueError, match="query heads"):
        paged_prefill_attention_triton(
            q[:, :3],
            paged.k_cache,
            paged.v_cache,
            paged.block_tables,
            cu_seqlens,
            paged.context_lens,
            0.3,
        )


def chunk_kv(paged, query_lens: list[int], context_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The k/v of each sequence's new tokens (its last query_len positions), packed [T, Hkv, D]."""
    keys = [k[length - n :] for k, n, length in zip(paged.dense_k, query_lens, context_lens)]
    values = [v[length - n :] for v, n, length in zip(paged.dense_v, query_lens, context_lens)]
    return torch.cat(keys), torch.cat(values)


def test_prefill_backend_threshold_follows_the_environment(monkeypatch):
    monkeypatch.delenv(PREFILL_BACKEND_ENV_VAR, raising=False)
    assert sdpa_min_prefill_len() == SDPA_MIN_PREFILL_LEN
    monkeypatch.setenv(PREFILL_BACKEND_ENV_VAR, "sdpa")
    assert sdpa_min_prefill_len() == 1
    monkeypatch.setenv(PREFILL_BACKEND_ENV_VAR, "triton")
    assert sdpa_min_prefill_len() == NEVER
    monkeypatch.setenv(PREFILL_BACKEND_ENV_VAR, "flash")  # the varlen kernel first; without it, as auto
    assert sdpa_min_prefill_len() == SDPA_MIN_PREFILL_LEN
    monkeypatch.setenv(PREFILL_BACKEND_ENV_VAR, "cudnn")
    with pytest.raises(ValueError, match="VLM_CATALOG_PREFILL_ATTENTION='cudnn' is not one of auto, flash, triton, sdpa"):
        sdpa_min_prefill_len()


@pytest.mark.parametrize("cache", ["same", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_prompts_through_sdpa_the_rest_through_one_launch(
    triton_device, poison_allocations, monkeypatch, dtype, cache
):
    """Whole prompts of at least the threshold (here 6) run SDPA on their own k/v, rounded as
    the cache holds them; chunks after a prefix, short prompts and empty chunks run in one
    Triton launch that skips the former. Together: the reference over the cache, at
    TOLERANCE[dtype] (poisoned allocations show a row nobody wrote)."""
    monkeypatch.delenv(PREFILL_BACKEND_ENV_VAR, raising=False)
    monkeypatch.setattr(prefill_module, "SDPA_MIN_PREFILL_LEN", 6)
    query_lens, context_lens = [8, 3, 0, 7, 10, 5], [8, 20, 5, 7, 30, 5]  # SDPA: sequences 0 and 3
    paged = build_paged_kv(context_lens, 4, 2, 16, dtype, triton_device)
    if cache == "fp8":
        paged.k_cache, paged.v_cache = to_cache_dtype(paged.k_cache, FP8_DTYPE), to_cache_dtype(paged.v_cache, FP8_DTYPE)
    q, cu_seqlens = packed_queries(query_lens, 8, 16, dtype, triton_device)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, cu_seqlens, paged.context_lens, 0.25)
    new_k, new_v = chunk_kv(paged, query_lens, context_lens)
    out = paged_prefill_attention_per_sequence(
        q, new_k, new_v, *args[1:], query_lens=query_lens, kv_lens=context_lens
    )
    assert_close(out, paged_prefill_attention_reference(*args), rel=TOLERANCE[dtype])
    # the Triton launch alone leaves exactly the SDPA sequences' rows unwritten
    skipped = paged_prefill_attention_triton(*args, skip_fresh_from=6)
    assert torch.isnan(skipped[:8]).all() and torch.isnan(skipped[11:18]).all()
    assert not torch.isnan(skipped[8:11]).any() and not torch.isnan(skipped[18:]).any()


# fresh prompts (0, 3, 5; 5 shorter than any threshold), chunks after a prefix (1, 4), none (2)
FLASH_QUERY_LENS, FLASH_CONTEXT_LENS = [8, 3, 0, 7, 10, 2], [8, 20, 5, 7, 30, 2]
FRESH_QUERY_LENS, FRESH_CONTEXT_LENS = [8, 0, 7, 2], [8, 5, 7, 2]  # whole prompts only (and one without queries)


def flash_case(dtype, device, cache: str = "same", query_lens=FLASH_QUERY_LENS, context_lens=FLASH_CONTEXT_LENS):
    """Arguments of paged_prefill_attention_per_sequence: 8 query heads over 2 KV heads,
    `query_lens` chunks with `context_lens` cached after them."""
    paged = build_paged_kv(context_lens, 4, 2, 16, dtype, device)
    if cache == "fp8":
        paged.k_cache, paged.v_cache = to_cache_dtype(paged.k_cache, FP8_DTYPE), to_cache_dtype(paged.v_cache, FP8_DTYPE)
    q, cu_seqlens = packed_queries(query_lens, 8, 16, dtype, device)
    new_k, new_v = chunk_kv(paged, query_lens, context_lens)
    return {"q": q, "new_k": new_k, "new_v": new_v, "k_cache": paged.k_cache, "v_cache": paged.v_cache,
            "block_tables": paged.block_tables, "cu_seqlens_q": cu_seqlens, "context_lens": paged.context_lens,
            "scale": 16**-0.5, "query_lens": query_lens, "kv_lens": context_lens}


def fresh_case(dtype, device, cache: str = "same"):
    return flash_case(dtype, device, cache, FRESH_QUERY_LENS, FRESH_CONTEXT_LENS)


def reference(case):
    keys = ("q", "k_cache", "v_cache", "block_tables", "cu_seqlens_q", "context_lens", "scale")
    return paged_prefill_attention_reference(*(case[key] for key in keys))


def alignment_check(call) -> bool:
    """The once-per-device check of the causal mask's alignment (3 queries over 7 keys, 2 over 2)."""
    return call["cu_seq_k"].tolist() == [0, 7, 9] and call["cu_seq_q"].tolist() == [0, 3, 5]


@pytest.mark.parametrize("cache", ["same", "fp8"])
@pytest.mark.parametrize("fake", [FakeFlashVarlen, FakeFlashVarlenIsCausal])
def test_whole_prompts_in_one_causal_varlen_call_on_their_own_kv(
    triton_device, poison_allocations, fake_flash, fake, cache
):
    """Nothing cached before any chunk: one causal varlen call on the chunks' own k/v (rounded
    as the cache holds them), grouped-query heads in the keywords of either torch version; the
    reference over the cache at TOLERANCE[bfloat16], with no row left unwritten."""
    kernel = fake_flash(fake())
    case = fresh_case(torch.bfloat16, triton_device, cache)
    assert_close(paged_prefill_attention_per_sequence(**case), reference(case), rel=TOLERANCE[torch.bfloat16])
    (call,) = kernel.calls
    assert call["cu_seq_q"].dtype == torch.int32 and call["cu_seq_q"].tolist() == [0, 8, 8, 15, 17]
    assert call["cu_seq_k"].tolist() == [0, 8, 8, 15, 17] and call["max_q"] == 8
    if fake is FakeFlashVarlen:
        assert call["window_size"] == (-1, 0) and call["enable_gqa"] and call["scale"] is None
    else:
        assert call["is_causal"]


@pytest.mark.parametrize("cache", ["same", "fp8"])
@pytest.mark.parametrize("fake", [FakeFlashVarlen, FakeFlashVarlenIsCausal])
def test_chunks_with_a_cached_context_over_packed_contexts(triton_device, poison_allocations, fake_flash, fake, cache):
    """Some chunks follow a cached context: after the alignment check (once), one causal varlen
    call over every sequence's whole context gathered from the cache (keys packed by
    cumulative context length); the reference at TOLERANCE[bfloat16]."""
    kernel = fake_flash(fake())
    case = flash_case(torch.bfloat16, triton_device, cache)
    assert_close(paged_prefill_attention_per_sequence(**case), reference(case), rel=TOLERANCE[torch.bfloat16])
    check, call = kernel.calls
    assert alignment_check(check)
    assert call["cu_seq_q"].tolist() == [0, 8, 11, 11, 18, 28, 30]
    assert call["cu_seq_k"].tolist() == [0, 8, 28, 33, 40, 70, 72] and call["max_q"] == 10
    contexts = PackedContexts(case["block_tables"], case["context_lens"], FLASH_CONTEXT_LENS)
    assert_close(paged_prefill_attention_per_sequence(**case, contexts=contexts), reference(case),
                 rel=TOLERANCE[torch.bfloat16])
    assert len(kernel.calls) == 3  # checked once; the step's shared layout gives the same answer
    if fake is FakeFlashVarlen:
        assert call["max_k"] == 30 and call["window_size"] == (-1, 0)


def test_packed_contexts_are_the_cached_tokens_in_order(triton_device):
    paged = build_paged_kv([5, 0, 9], 4, 2, 16, torch.float32, triton_device)
    contexts = PackedContexts(paged.block_tables, paged.context_lens, [5, 0, 9])
    slots, cu_seqlens_k = contexts.layout(4)
    assert cu_seqlens_k.tolist() == [0, 5, 5, 14] and slots.shape == (14,) and contexts.max_len == 9
    packed = contexts.gather(paged.k_cache, torch.float32)
    assert torch.equal(packed, torch.cat([paged.dense_k[0][:5], paged.dense_k[2][:9]]))
    assert contexts.layout(4)[0] is slots  # computed once
    fp8 = to_cache_dtype(paged.k_cache, FP8_DTYPE)  # gathered as bytes: the same values
    assert torch.equal(contexts.gather(fp8, torch.float32), packed.to(FP8_DTYPE).to(torch.float32))


def test_a_top_left_aligned_kernel_is_caught_and_the_chunks_still_right(triton_device, fake_flash, caplog):
    """A kernel that aligns the causal mask top-left fails the check once: chunks with a cached
    context go through the Triton launch from then on, the fresh ones through the varlen call
    (where alignment does not matter); the answer is the reference's."""
    kernel = fake_flash(FakeFlashVarlen(align="top-left"))
    case = flash_case(torch.bfloat16, triton_device)
    for _ in range(2):
        assert_close(paged_prefill_attention_per_sequence(**case), reference(case), rel=TOLERANCE[torch.bfloat16])
    assert "causal mask is not aligned bottom-right" in caplog.text
    check, *calls = kernel.calls
    assert alignment_check(check) and len(calls) == 2 and all(call["num_keys"] == 30 for call in calls)


def test_past_gather_max_keys_fresh_chunks_alone_take_the_varlen_call(
    triton_device, poison_allocations, fake_flash, monkeypatch
):
    kernel = fake_flash(FakeFlashVarlen())
    monkeypatch.setattr(prefill_module, "GATHER_MAX_KEYS", 71)  # the contexts hold 72 tokens
    case = flash_case(torch.bfloat16, triton_device)
    assert_close(paged_prefill_attention_per_sequence(**case), reference(case), rel=TOLERANCE[torch.bfloat16])
    (call,) = kernel.calls
    assert call["num_keys"] == 30 and call["cu_seq_k"].tolist() == [0, 8, 11, 11, 18, 28, 30]  # own k/v


def test_the_varlen_kernel_is_only_asked_for_16_bit_queries(triton_device, fake_flash, monkeypatch):
    kernel = fake_flash(FakeFlashVarlen())
    paged_prefill_attention_per_sequence(**flash_case(torch.float32, triton_device))  # not FlashAttention's dtype
    case = flash_case(torch.bfloat16, triton_device)
    paged_prefill_attention_per_sequence(**case, threshold=6, flash=False)  # the per-chunk SDPA path alone
    for backend in ("sdpa", "triton"):
        monkeypatch.setenv(PREFILL_BACKEND_ENV_VAR, backend)
        paged_prefill_attention_per_sequence(**case)
    assert kernel.calls == []
    monkeypatch.setenv(PREFILL_BACKEND_ENV_VAR, "flash")
    paged_prefill_attention_per_sequence(**fresh_case(torch.bfloat16, triton_device))
    assert len(kernel.calls) == 1


def test_whole_prompts_with_one_long_enough_for_sdpa_go_per_chunk(
    triton_device, poison_allocations, fake_flash, monkeypatch
):
    """The H100 measured per-prompt SDPA 1.05-1.7x faster than the varlen kernel on prompts of
    1024 tokens and more, and the Triton launch ahead of it below: a fresh call with a chunk of
    at least SDPA_MIN_PREFILL_LEN tokens skips the kernel unless the environment forces it.
    Tolerance: TOLERANCE[bfloat16], the per-chunk path's own."""
    kernel = fake_flash(FakeFlashVarlen())
    monkeypatch.setattr(prefill_module, "SDPA_MIN_PREFILL_LEN", 8)  # FRESH_QUERY_LENS: 8, 0, 7, 2
    case = fresh_case(torch.bfloat16, triton_device)
    assert_close(paged_prefill_attention_per_sequence(**case), reference(case), rel=TOLERANCE[torch.bfloat16])
    assert kernel.calls == []
    monkeypatch.setattr(prefill_module, "SDPA_MIN_PREFILL_LEN", 9)  # all shorter: one varlen call
    paged_prefill_attention_per_sequence(**case)
    assert len(kernel.calls) == 1
    monkeypatch.setattr(prefill_module, "SDPA_MIN_PREFILL_LEN", 8)
    monkeypatch.setenv(PREFILL_BACKEND_ENV_VAR, "flash")
    paged_prefill_attention_per_sequence(**case)
    assert len(kernel.calls) == 2


def test_a_causal_varlen_kernel_that_fails_hands_over_for_good(triton_device, fake_flash, monkeypatch, caplog):
    # tolerance: TOLERANCE[bfloat16], the fallback's own
    kernel = fake_flash(FakeFlashVarlen(RuntimeError("window_size is not supported")))
    monkeypatch.setattr(prefill_module, "SDPA_MIN_PREFILL_LEN", 9)  # every fresh chunk shorter: the kernel is asked
    case = flash_case(torch.bfloat16, triton_device)
    for _ in range(2):
        assert_close(paged_prefill_attention_per_sequence(**case), reference(case), rel=TOLERANCE[torch.bfloat16])
    assert len(kernel.calls) == 2  # the alignment check, then the fresh chunks' call; neither tried again
    for use in ("causal with context", "causal"):
        assert f"FlashAttention varlen (torch) failed for {use} attention (RuntimeError: window_size" in caplog.text
    assert flash_varlen_usable(case["q"], "bidirectional")  # the vision tower's use is not affected


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "sdpa", "flash", "auto"])
def test_gpu_paged_prefill_model_shapes(cuda_device, monkeypatch, backend):
    # tolerance: 1e-2 (bfloat16); a 2k-token chunk after a 6k prefix, two fresh prompts (one past
    # the SDPA threshold) and a one-token chunk, with the engine's per-sequence backend choice
    monkeypatch.setenv(PREFILL_BACKEND_ENV_VAR, backend)
    query_lens, context_lens = [2048, 700, 1, 1800], [8192, 700, 3000, 1800]
    paged = build_paged_kv(context_lens, 16, 4, 128, torch.bfloat16, cuda_device)
    q, cu_seqlens = packed_queries(query_lens, 32, 128, torch.bfloat16, cuda_device)
    args = (
        q,
        paged.k_cache,
        paged.v_cache,
        paged.block_tables,
        cu_seqlens,
        paged.context_lens,
        128**-0.5,
    )
    expected = paged_prefill_attention_reference(*args)
    assert_close(kernels.paged_prefill_attention(*args), expected, rel=1e-2)
    out = kernels.paged_prefill_attention(*args, new_kv=chunk_kv(paged, query_lens, context_lens),
                                          host_lens=(query_lens, context_lens))
    assert_close(out, expected, rel=1e-2)


def test_short_extends_after_a_shared_prefix_match_per_sequence_attention(monkeypatch):
    """Jump-forward-like chunks (1-16 tokens after a shared, prefix-cached system prompt) take the
    batched path; they equal the per-sequence SDPA path (1e-5 relative, float32), and chunks
    longer than SHORT_EXTEND_QUERIES still run per sequence. Unread cache slots hold NaN."""
    generator = torch.Generator().manual_seed(5)
    block_size, kv_heads, q_heads, head_dim, num_blocks = 4, 2, 4, 8, 64
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    v_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    shared = [1, 2, 3]  # 12 tokens every sequence starts with
    query_lens = [1, 5, 16, 17, 3]
    context_lens = [20, 14, 30, 29, 12 + 3]
    tables = torch.full((len(query_lens), 8), 63, dtype=torch.int32)  # block 63: NaN, never read
    next_block = 10
    for row, context_len in enumerate(context_lens):
        own = list(range(next_block, next_block + -(-(context_len - 12) // block_size)))
        next_block += len(own)
        tables[row, : 3 + len(own)] = torch.tensor(shared + own, dtype=torch.int32)
        for position in range(context_len):
            block, slot = int(tables[row, position // block_size]), position % block_size
            k_cache[block, slot] = torch.randn(kv_heads, head_dim, generator=generator)
            v_cache[block, slot] = torch.randn(kv_heads, head_dim, generator=generator)
    cu_seqlens = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_seqlens[-1]), q_heads, head_dim, generator=generator)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    routed = paged_prefill_attention_reference(q, k_cache, v_cache, tables, cu_seqlens, lens, 0.3)
    monkeypatch.setattr(prefill_module, "SHORT_EXTEND_QUERIES", 0)
    per_sequence = paged_prefill_attention_reference(q, k_cache, v_cache, tables, cu_seqlens, lens, 0.3)
    assert not torch.isnan(routed).any()
    assert_close(routed, per_sequence, rel=1e-5, what="batched short extends vs per-sequence SDPA")


def test_the_engine_backend_shares_one_packed_layout_across_layers(triton_device, fake_flash):
    """`PagedAttention` (one per step) hands every layer the same `PackedContexts`: its cache
    slots are computed by the first layer and reused by the next; each layer's answer is the
    reference's (TOLERANCE[bfloat16])."""
    from vlm_catalog.engine.paged_attention import (
        PagedAttention,
        PagedAttentionMetadata,
        PrefillBatch,
    )

    fake_flash(FakeFlashVarlen())
    first = flash_case(torch.bfloat16, triton_device)
    second = {**first, "q": first["q"].flip(0).contiguous(), "k_cache": first["k_cache"] * 2,
              "v_cache": -first["v_cache"]}  # the same block tables over other values
    layers = [first, second]
    slots = torch.cat([torch.arange(length - n, length) + 1000 * seq  # never written: the chunks are cached
                       for seq, (n, length) in enumerate(zip(FLASH_QUERY_LENS, FLASH_CONTEXT_LENS))])
    metadata = PagedAttentionMetadata(decode=None, prefill=PrefillBatch(
        slot_mapping=torch.full_like(slots, -1), block_tables=first["block_tables"],
        cu_seqlens_q=first["cu_seqlens_q"], context_lens=first["context_lens"], max_query_len=10,
        host_lens=(FLASH_QUERY_LENS, FLASH_CONTEXT_LENS),
    ))
    attention = PagedAttention([(case["k_cache"], case["v_cache"]) for case in layers], metadata)
    layout = None
    for index, case in enumerate(layers):
        out = attention.attend(index, case["q"], case["new_k"], case["new_v"], case["scale"])
        assert_close(out, reference(case), rel=TOLERANCE[torch.bfloat16], what=f"layer {index}")
        slots_now = attention.prefill_contexts.layout(4)[0]
        assert layout is None or slots_now is layout
        layout = slots_now
