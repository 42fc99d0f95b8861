"""FlashAttention 3 as the varlen kernel (`VLM_CATALOG_FLASH_VARLEN=fa3`, kernels/flash_varlen.py):
found, called with FA3's own keywords, refused where it cannot run, and let take long sequences,
through a stand-in on CPU (the real kernels need an H100: the gpu tests at the end)."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from kernels import flash_varlen
from kernels.flash_varlen import (
    FLASH_VARLEN_ENV_VAR,
    flash_takes_long_sequences,
    flash_varlen_attention,
    flash_varlen_module,
    flash_varlen_provider,
    flash_varlen_usable,
    try_flash_varlen_attention,
)
from kernels.paged_prefill_attention import (
    SDPA_MIN_PREFILL_LEN,
    whole_prompts_take_the_varlen_kernel,
)
from kernels.varlen_attention import varlen_attention_on_device, varlen_attention_reference
from tests.kernels.flash_fakes import FakeFa3Varlen, FakeFlashVarlen, segment_attention
from tests.kernels.helpers import assert_close


def packed(lengths: list[int], num_q: int, num_kv: int, head_dim: int = 16, dtype=torch.bfloat16):
    """q [N, num_q, D], k and v [N, num_kv, D] and int64 bounds for segments of `lengths`."""
    total = sum(lengths)
    q = torch.randn(total, num_q, head_dim).to(dtype)
    k, v = (torch.randn(total, num_kv, head_dim).to(dtype) for _ in range(2))
    return q, k, v, torch.tensor([0, *lengths]).cumsum(0)


def test_asked_for_it_runs_the_fa3_call_with_its_own_keywords(fake_fa3, monkeypatch):
    """Causal grouped-query prompts: FA3 gets `softmax_scale` and `causal`, int32 bounds and the
    KV heads as they are (it takes fewer natively). Tolerance: exact, the stand-in computes what
    the reference does."""
    fa3 = fake_fa3(FakeFa3Varlen())
    monkeypatch.setenv(FLASH_VARLEN_ENV_VAR, "torch")
    assert flash_varlen_provider() == "torch" and not flash_takes_long_sequences()  # installed, not asked for
    monkeypatch.setenv(FLASH_VARLEN_ENV_VAR, "fa3")
    assert flash_varlen_provider() == "fa3" and flash_varlen_module() == "fa3_fwd_interface"
    assert flash_takes_long_sequences()
    q, k, v, bounds = packed([7, 1, 12], num_q=4, num_kv=2)
    out = flash_varlen_attention(q, k, v, bounds, 0.3, 12, causal=True)
    (call,) = fa3.calls
    assert call["softmax_scale"] == 0.3 and call["causal"] is True and call["num_kv_heads"] == 2
    assert call["cu_seq_q"].dtype == torch.int32 and call["cu_seq_q"].tolist() == [0, 7, 8, 20]
    assert call["max_q"] == call["max_k"] == 12 and call["rest"] == {}
    assert torch.equal(out, segment_attention(q, k, v, bounds, 0.3, causal=True))
    flash_varlen_attention(q, k, v, bounds, 16**-0.5, 12)  # bidirectional; the default scale
    assert fa3.calls[1]["causal"] is False and fa3.calls[1]["softmax_scale"] is None


def test_an_older_build_returning_the_log_sum_exp_too_gives_the_output(fake_fa3, monkeypatch):
    fake_fa3(FakeFa3Varlen(returns_lse=True), interface="flash_attn_interface", float16=True)
    monkeypatch.setenv(FLASH_VARLEN_ENV_VAR, "fa3")
    assert flash_varlen_module() == "flash_attn_interface"
    q, k, v, bounds = packed([5, 9], num_q=2, num_kv=2)
    out = flash_varlen_attention(q, k, v, bounds, 0.25, 9)
    assert torch.equal(out, segment_attention(q, k, v, bounds, 0.25, causal=False))


def test_a_build_from_source_comes_before_the_forward_only_wheel(fake_fa3, monkeypatch):
    wheel, source = FakeFa3Varlen(), FakeFa3Varlen()
    fake_fa3(wheel)
    fake_fa3(source, interface="flash_attn_interface")
    monkeypatch.setenv(FLASH_VARLEN_ENV_VAR, "fa3")
    q, k, v, bounds = packed([3], num_q=2, num_kv=2)
    flash_varlen_attention(q, k, v, bounds, 0.25, 3)
    assert len(source.calls) == 1 and wheel.calls == []


def test_the_dtypes_follow_the_builds_flags(fake_fa3, monkeypatch):
    """fa3-fwd compiles no float16 kernels: such a call stays with the callers' other backends
    instead of failing once and turning the use off."""
    fake_fa3(FakeFa3Varlen())
    monkeypatch.setenv(FLASH_VARLEN_ENV_VAR, "fa3")
    assert flash_varlen_usable(torch.zeros(2, 2, 16, dtype=torch.bfloat16), "causal")
    assert not flash_varlen_usable(torch.zeros(2, 2, 16, dtype=torch.float16), "causal")
    fake_fa3(FakeFa3Varlen(), interface="flash_attn_interface", float16=True)
    assert flash_varlen_usable(torch.zeros(2, 2, 16, dtype=torch.float16), "causal")


def test_asked_for_where_it_cannot_run_torchs_call_runs_after_one_warning(fake_fa3, monkeypatch, caplog):
    fake_fa3(FakeFa3Varlen())  # installed ...
    monkeypatch.setattr(flash_varlen, "fa3_device_supported", lambda: False)  # ... but no Hopper GPU here
    flash_varlen.fa3_varlen_function.cache_clear()
    monkeypatch.setenv(FLASH_VARLEN_ENV_VAR, "fa3")
    with caplog.at_level(logging.WARNING, logger="kernels.flash_varlen"):
        assert flash_varlen_provider() == "torch" and flash_varlen_provider() == "torch"
    assert caplog.text.count("FlashAttention 3 cannot run here") == 1
    assert "no GPU of compute capability 9.x" in caplog.text
    assert not flash_takes_long_sequences()


def test_by_default_fa3_runs_where_it_can_and_torchs_call_elsewhere_without_a_warning(fake_fa3, monkeypatch, caplog):
    """`auto` (unset): FA3 wherever it loads on a Hopper GPU (faster at every length on the H200
    of 2026-11-27), torch's FlashAttention 2 where it is not installed or cannot run, silently."""
    monkeypatch.delenv(FLASH_VARLEN_ENV_VAR, raising=False)
    with caplog.at_level(logging.WARNING, logger="kernels.flash_varlen"):
        assert flash_varlen_provider() == "torch" and not flash_takes_long_sequences()  # not installed
        fa3 = fake_fa3(FakeFa3Varlen())
        assert flash_varlen_provider() == "fa3" and flash_takes_long_sequences()
        q, k, v, bounds = packed([3, 5], num_q=2, num_kv=2)
        flash_varlen_attention(q, k, v, bounds, 0.25, 5)
        assert len(fa3.calls) == 1
        monkeypatch.setattr(flash_varlen, "fa3_device_supported", lambda: False)  # not a Hopper GPU
        flash_varlen.fa3_varlen_function.cache_clear()
        monkeypatch.setenv(FLASH_VARLEN_ENV_VAR, " AUTO ")
        assert flash_varlen_provider() == "torch"
    assert caplog.text == ""


def test_not_installed_says_what_was_tried(fake_fa3, monkeypatch):
    monkeypatch.setenv(FLASH_VARLEN_ENV_VAR, "fa3")
    assert flash_varlen.fa3_varlen_function() is None
    reason = flash_varlen.fa3_unavailable_reason()
    assert "neither flash_attn_interface nor fa3_fwd_interface imports" in reason
    assert "pip install fa3-fwd" in reason
    monkeypatch.setenv(FLASH_VARLEN_ENV_VAR, "fa4")
    with pytest.raises(ValueError, match="VLM_CATALOG_FLASH_VARLEN='fa4' is not one of auto, torch, fa3"):
        flash_varlen_provider()


def test_a_failure_turns_off_fa3_for_that_use_and_not_torchs_call(fake_fa3, monkeypatch, caplog):
    fa3 = fake_fa3(FakeFa3Varlen(RuntimeError("FlashAttention-3 only supports Hopper")))
    torch_call = FakeFlashVarlen()
    monkeypatch.setattr(flash_varlen, "torch_varlen_function", lambda: torch_call)
    monkeypatch.setenv(FLASH_VARLEN_ENV_VAR, "fa3")
    q, k, v, bounds = packed([4, 6], num_q=2, num_kv=2)
    assert try_flash_varlen_attention("bidirectional", q, k, v, bounds, 0.25, 6) is None
    assert not flash_varlen_usable(q, "bidirectional") and flash_varlen_usable(q, "causal")
    assert "FlashAttention varlen (fa3) failed for bidirectional attention (RuntimeError" in caplog.text
    monkeypatch.setenv(FLASH_VARLEN_ENV_VAR, "torch")
    assert flash_varlen_usable(q, "bidirectional")
    assert try_flash_varlen_attention("bidirectional", q, k, v, bounds, 0.25, 6) is not None
    assert len(fa3.calls) == 1 and len(torch_call.calls) == 1


def test_with_fa3_the_vision_tower_sends_long_images_to_the_one_call(fake_fa3, monkeypatch):
    """Long segments go per segment to SDPA with torch's FlashAttention 2 varlen call (measured
    slower there), and all in one call with FA3. Tolerance: exact (the stand-in is SDPA)."""
    monkeypatch.setattr(sys.modules["kernels.varlen_attention"], "SDPA_MIN_SEGMENT_LEN", 30)
    fa3 = fake_fa3(FakeFa3Varlen())
    torch_call = FakeFlashVarlen()
    monkeypatch.setattr(flash_varlen, "torch_varlen_function", lambda: torch_call)
    q, k, v, bounds = packed([5, 40, 9], num_q=2, num_kv=2)
    monkeypatch.setenv(FLASH_VARLEN_ENV_VAR, "fa3")
    out = varlen_attention_on_device(q, k, v, bounds, 0.25, seqlens=[5, 40, 9])
    (call,) = fa3.calls
    assert call["max_q"] == 40 and call["causal"] is False
    assert torch.equal(out, varlen_attention_reference(q, k, v, bounds, 0.25))
    assert torch_call.calls == []


def test_with_fa3_whole_prompts_of_any_length_take_the_varlen_call(fake_fa3, monkeypatch):
    fake_fa3(FakeFa3Varlen())
    long_prompt = [SDPA_MIN_PREFILL_LEN + 500]
    monkeypatch.setenv(FLASH_VARLEN_ENV_VAR, "torch")
    assert not whole_prompts_take_the_varlen_kernel(long_prompt, long_prompt)  # FA2's crossover
    monkeypatch.setenv(FLASH_VARLEN_ENV_VAR, "fa3")
    assert whole_prompts_take_the_varlen_kernel(long_prompt, long_prompt)
    assert not whole_prompts_take_the_varlen_kernel([100], [600])  # a chunk after a cached context


def fa3_on_this_gpu():
    function = flash_varlen.fa3_varlen_function()
    if function is None:
        pytest.skip(f"FlashAttention 3 cannot run here: {flash_varlen.fa3_unavailable_reason()}")
    return function


@pytest.mark.gpu
def test_gpu_fa3_vision_heads_of_72_match_per_image_sdpa(cuda_device):
    # tolerance: 1e-2 (bfloat16) against per-segment SDPA; the vision tower's 16 heads of 72 (FA3
    # runs them in its 96-wide kernels), images of 64 to 5000 patches in one call
    function = fa3_on_this_gpu()
    lengths = [4096, 64, 5000, 300]
    bounds = torch.tensor([0, *lengths], device=cuda_device).cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(sum(lengths), 16, 72, dtype=torch.bfloat16, device=cuda_device) for _ in range(3))
    out = function(q, k, v, bounds, bounds, max(lengths), max(lengths), scale=72**-0.5)
    assert_close(out, segment_attention(q, k, v, bounds, 72**-0.5, causal=False), rel=1e-2)


@pytest.mark.gpu
def test_gpu_fa3_causal_prompts_and_chunks_after_a_context(cuda_device):
    # tolerance: 1e-2 (bfloat16) against per-segment masked SDPA; the text model's heads (32 over
    # 4 of 128): whole prompts, then a 2k-token chunk after 6k cached (bottom-right causal)
    function = fa3_on_this_gpu()
    lengths = [700, 1, 1800, 33]
    bounds = torch.tensor([0, *lengths], device=cuda_device).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lengths), 32, 128, dtype=torch.bfloat16, device=cuda_device)
    k, v = (torch.randn(sum(lengths), 4, 128, dtype=torch.bfloat16, device=cuda_device) for _ in range(2))
    out = function(q, k, v, bounds, bounds, max(lengths), max(lengths), scale=128**-0.5, window_size=(-1, 0))
    assert_close(out, segment_attention(q, k, v, bounds, 128**-0.5, causal=True), rel=1e-2)
    query_lens, key_lens = [2048, 5], [8192, 5]
    bounds_q, bounds_k = (torch.tensor([0, *n], device=cuda_device).cumsum(0).to(torch.int32)
                          for n in (query_lens, key_lens))
    q = torch.randn(sum(query_lens), 32, 128, dtype=torch.bfloat16, device=cuda_device)
    k, v = (torch.randn(sum(key_lens), 4, 128, dtype=torch.bfloat16, device=cuda_device) for _ in range(2))
    out = function(q, k, v, bounds_q, bounds_k, 2048, 8192, scale=128**-0.5, window_size=(-1, 0))
    expected = segment_attention(q, k, v, bounds_q, 128**-0.5, causal=True, cu_seq_k=bounds_k)
    assert_close(out, expected, rel=1e-2)


def test_an_install_whose_operators_fail_to_register_is_passed_over(fake_fa3, monkeypatch, tmp_path):
    """A wheel built for another torch can fail at import with other errors than ImportError (its
    library's OSError, its operators' RuntimeError): torch's kernel runs, and the reason says why."""
    (tmp_path / "fa3_fwd_interface.py").write_text(
        "raise RuntimeError('Tried to register an operator (fa3_fwd::fwd) with the same name twice')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fa3_fwd_interface")  # the fixture's "not installed" entry
    monkeypatch.setenv(FLASH_VARLEN_ENV_VAR, "fa3")
    assert flash_varlen_provider() == "torch"
    assert "fa3_fwd_interface: RuntimeError: Tried to register an operator" in flash_varlen.fa3_unavailable_reason()
