"""The paged caches' memory layout (`VLM_CATALOG_KV_LAYOUT`, kernels/kv_cache.py): a head-major
pool is the same [blocks, block, Hkv, D] tensor with each page's KV heads apart in memory. Every
writer and reader gives the same bits on it as on the interleaved pool, the readers without
copying it whole, and the engine answers the same."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.fp8 import FP8_DTYPE
from kernels.kv_cache import (
    KV_LAYOUT_ENV_VAR,
    PackedContexts,
    kv_layout,
    reshape_and_cache_reference,
    zeros_paged_cache,
)
from kernels.paged_decode_attention import (
    paged_decode_attention_reference,
    paged_decode_attention_triton,
)
from kernels.paged_prefill_attention import paged_prefill_attention_triton
from tests.kernels.paged import build_paged_kv


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """`cache` copied into a head-major pool of the same shape."""
    return zeros_paged_cache(*cache.shape, cache.dtype, cache.device, "head_major").copy_(cache)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.element_size() == 1:  # FP8: compared as bytes
        return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def test_pools_in_each_layout_and_the_variable_that_picks_one(monkeypatch):
    interleaved = zeros_paged_cache(5, 16, 4, 8, torch.bfloat16, "cpu", "interleaved")
    pool = zeros_paged_cache(5, 16, 4, 8, torch.bfloat16, "cpu", "head_major")
    assert pool.shape == interleaved.shape == (5, 16, 4, 8) and interleaved.is_contiguous()
    assert pool.stride() == (4 * 16 * 8, 8, 16 * 8, 1)  # a page's head rows together
    assert not pool.any()
    with pytest.raises(ValueError, match="'diagonal' is not one of interleaved, head_major"):
        zeros_paged_cache(1, 16, 4, 8, torch.bfloat16, "cpu", "diagonal")
    monkeypatch.delenv(KV_LAYOUT_ENV_VAR, raising=False)
    assert kv_layout() == "interleaved"
    monkeypatch.setenv(KV_LAYOUT_ENV_VAR, "head_major")
    assert kv_layout() == "head_major" and not zeros_paged_cache(2, 4, 2, 8, torch.float32, "cpu").is_contiguous()
    monkeypatch.setenv(KV_LAYOUT_ENV_VAR, "sideways")
    with pytest.raises(ValueError, match="VLM_CATALOG_KV_LAYOUT='sideways' is not one of interleaved, head_major"):
        kv_layout()


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8_DTYPE])
def test_writes_land_in_the_same_slots_of_either_layout(triton_device, cache_dtype):
    k, v = torch.randn(2, 9, 2, 16).to(triton_device)
    slots = torch.tensor([3, 17, -1, 0, 31, 8, 22, 5, 40], device=triton_device)
    pools = {layout: [zeros_paged_cache(3, 16, 2, 16, cache_dtype, triton_device, layout) for _ in range(2)]
             for layout in ("interleaved", "head_major")}
    kernels.reshape_and_cache(k, v, *pools["head_major"], slots)  # the Triton kernel (triton_device)
    reshape_and_cache_reference(k, v, *pools["interleaved"], slots)
    for interleaved, head in zip(pools["interleaved"], pools["head_major"]):
        assert same_bits(head.contiguous(), interleaved)


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8_DTYPE])
def test_readers_give_the_same_bits_on_either_layout(triton_device, cache_dtype):
    paged = build_paged_kv([70, 5, 33], 16, 2, 32, torch.float32, triton_device)
    k_cache, v_cache = (torch.nan_to_num(cache).to(cache_dtype) for cache in (paged.k_cache, paged.v_cache))
    k_head, v_head = head_major(k_cache), head_major(v_cache)
    block_tables = paged.block_tables.clamp_min(0)
    q = torch.randn(3, 4, 32).to(triton_device)
    triton_options = {"max_context_len": 70, "num_splits": 4}  # several splits: the in-place merge too
    for decode, options in ((paged_decode_attention_triton, triton_options), (paged_decode_attention_reference, {})):
        expected = decode(q, k_cache, v_cache, block_tables, paged.context_lens, 0.2, **options)
        got = decode(q, k_head, v_head, block_tables, paged.context_lens, 0.2, **options)
        assert torch.equal(got, expected), decode.__name__
    contexts = PackedContexts(block_tables, paged.context_lens, [70, 5, 33])
    for interleaved, head in ((k_cache, k_head), (v_cache, v_head)):
        assert torch.equal(contexts.gather(head, torch.float32), contexts.gather(interleaved, torch.float32))
    query_lens = torch.tensor([0, 4, 3, 6]).cumsum(0).to(torch.int32).to(triton_device)
    chunk = torch.randn(13, 4, 32).to(triton_device)
    args = (block_tables, query_lens, paged.context_lens, 0.2)
    assert torch.equal(paged_prefill_attention_triton(chunk, k_head, v_head, *args, max_query_len=6),
                       paged_prefill_attention_triton(chunk, k_cache, v_cache, *args, max_query_len=6))


def test_the_engine_answers_the_same_in_either_layout(tmp_path, monkeypatch):
    from tests.engine.conftest import conversation
    from tests.model.helpers import build_checkpoint
    from vlm_catalog import LLM, SamplingParams
    from vlm_catalog.model.tiny_checkpoint import build_tokenizer

    checkpoint = build_checkpoint(tmp_path / "tiny", build_tokenizer(1000), seed=3)
    conversations = [conversation(index, images=index % 2, words=3 + 9 * index) for index in range(4)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    answers = {}
    for layout in ("interleaved", "head_major"):
        monkeypatch.setenv(KV_LAYOUT_ENV_VAR, layout)
        llm = LLM(checkpoint, max_num_batched_tokens=64, enable_prefix_caching=True)  # chunked prompts
        k_cache, _ = llm.engine.kv_caches[0]
        assert k_cache.is_contiguous() == (layout == "interleaved")
        answers[layout] = [output.token_ids for output in llm.chat(conversations + conversations[:2], params)]
    assert answers["head_major"] == answers["interleaved"]
