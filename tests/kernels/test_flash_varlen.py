"""kernels.flash_varlen: the keywords built for each torch version's varlen_attn, and the
per-use switch-off after a failure (the attention itself: test_varlen_attention.py and
test_paged_prefill_attention.py, through stand-ins on CPU and the real kernel on GPU)."""

from __future__ import annotations

import pytest
import torch

from kernels.flash_varlen import (
    CAUSAL_WITH_CONTEXT,
    causal_with_context_supported,
    failure_reason,
    flash_varlen_attention,
    flash_varlen_options,
    flash_varlen_usable,
    try_flash_varlen_attention,
)
from tests.kernels.flash_fakes import FakeFlashVarlen, FakeFlashVarlenIsCausal, segment_attention
from tests.kernels.helpers import assert_close


def heads(num_q: int, num_kv: int, head_dim: int = 16):
    return torch.zeros(4, num_q, head_dim, dtype=torch.bfloat16), torch.zeros(4, num_kv, head_dim, dtype=torch.bfloat16)


def keywords_anything(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **options):
    return query


def keywords_scale_only(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
    return query


@pytest.mark.parametrize(
    "function,causal,num_kv,scale,expected",
    [
        (FakeFlashVarlen(), True, 2, 16**-0.5, {"window_size": (-1, 0), "enable_gqa": True}),
        (FakeFlashVarlen(), False, 8, 0.3, {"scale": 0.3}),
        (FakeFlashVarlenIsCausal(), True, 2, 16**-0.5, {"is_causal": True}),  # GQA as it is
        (FakeFlashVarlenIsCausal(), False, 8, 16**-0.5, {}),
        (FakeFlashVarlenIsCausal(), True, 2, 0.3, None),  # no scale keyword
        (keywords_scale_only, True, 8, 16**-0.5, None),  # no causal keyword
        (keywords_anything, True, 2, 0.3, {"scale": 0.3, "window_size": (-1, 0), "enable_gqa": True}),
    ],
)
def test_keywords_follow_the_installed_signature(function, causal, num_kv, scale, expected):
    q, k = heads(8, num_kv)
    assert flash_varlen_options(function, q, k, scale, causal) == expected


def test_a_call_the_version_cannot_express_switches_that_use_off(fake_flash, caplog):
    kernel = fake_flash(FakeFlashVarlenIsCausal())
    q, k = heads(8, 2)
    bounds = torch.tensor([0, 4], dtype=torch.int32)
    assert try_flash_varlen_attention("causal", q, k, k, bounds, 0.3, 4, causal=True) is None
    assert kernel.calls == []
    assert "FlashAttention varlen (torch) failed for causal attention (ValueError: torch" in caplog.text
    assert not flash_varlen_usable(q, "causal") and flash_varlen_usable(q, "bidirectional")
    out = try_flash_varlen_attention("bidirectional", q, k, k, bounds, 16**-0.5, 4)
    assert out is not None and len(kernel.calls) == 1


def test_usable_only_for_16_bit_tensors_on_a_device_it_runs_on(fake_flash, monkeypatch):
    fake_flash(FakeFlashVarlen())
    assert flash_varlen_usable(torch.zeros(2, 2, 16, dtype=torch.float16), "causal")
    assert not flash_varlen_usable(torch.zeros(2, 2, 16), "causal")  # float32
    assert not flash_varlen_usable(torch.zeros(2, 2, 12, dtype=torch.float16), "causal")  # head size
    monkeypatch.setattr("kernels.flash_varlen.FLASH_DEVICE_TYPES", ("cuda",))
    assert not flash_varlen_usable(torch.zeros(2, 2, 16, dtype=torch.float16), "causal")  # the real kernel: CUDA only


@pytest.mark.gpu
def test_gpu_causal_grouped_query_prompts_in_one_call(cuda_device):
    # tolerance: 1e-2 (bfloat16) against per-prompt causal SDPA; the text model's heads (32 over 4
    # of 128). Calls the kernel directly, so a torch that cannot take the call fails here loudly
    # instead of falling back
    lengths = [700, 1, 1800, 33]
    bounds = torch.tensor([0, *lengths], device=cuda_device).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lengths), 32, 128, dtype=torch.bfloat16, device=cuda_device)
    k, v = (torch.randn(sum(lengths), 4, 128, dtype=torch.bfloat16, device=cuda_device) for _ in range(2))
    out = flash_varlen_attention(q, k, v, bounds, 128**-0.5, max(lengths), causal=True)
    assert_close(out, segment_attention(q, k, v, bounds, 128**-0.5, causal=True), rel=1e-2)


@pytest.mark.gpu
def test_gpu_causal_mask_with_context_is_aligned_bottom_right(cuda_device):
    # the check the engine relies on before it sends chunks with a cached context to the kernel;
    # fails loudly (instead of falling back to the Triton kernel) so the GPU record shows it.
    # tolerance: 1e-2 (bfloat16) against per-chunk masked SDPA, a 2k-token chunk after 6k cached
    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16, device=cuda_device)
    assert causal_with_context_supported(q), failure_reason(CAUSAL_WITH_CONTEXT)
    query_lens, key_lens = [2048, 5], [8192, 5]
    bounds_q, bounds_k = (torch.tensor([0, *lengths], device=cuda_device).cumsum(0).to(torch.int32)
                          for lengths in (query_lens, key_lens))
    q = torch.randn(sum(query_lens), 32, 128, dtype=torch.bfloat16, device=cuda_device)
    k, v = (torch.randn(sum(key_lens), 4, 128, dtype=torch.bfloat16, device=cuda_device) for _ in range(2))
    out = flash_varlen_attention(q, k, v, bounds_q, 128**-0.5, 2048, causal=True, cu_seqlens_k=bounds_k,
                                 max_seqlen_k=8192)
    expected = segment_attention(q, k, v, bounds_q, 128**-0.5, causal=True, cu_seq_k=bounds_k)
    assert_close(out, expected, rel=1e-2)
