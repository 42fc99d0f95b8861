"""The decode kernel that norms and rotates a step's raw q and k itself (NORM_ROPE,
kernels/jit/paged_decode_attention.py) against `qk_norm_mrope` followed by the unfused kernel:
the same output and the same K written to the cache, in every split layout, for bf16 and FP8
caches and MRoPE positions whose three rows differ."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels.paged_decode_attention import (
    fuses_qk_norm_rope,
    paged_decode_attention_with_kv_write,
    paged_decode_attention_with_kv_write_triton,
)
from kernels.rotary import QKNormRope, qk_norm_mrope_reference
from tests.kernels.helpers import assert_close
from tests.kernels.paged import build_paged_kv

BLOCK_SIZE, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 8, 2, 32
SECTION = (8, 5, 3)  # sums to HEAD_DIM // 2; h and w differ, so swapping them shows


@dataclass
class DecodeStep:
    q: torch.Tensor  # [B, Hq, D] raw (before the norm and MRoPE)
    k: torch.Tensor  # [B, Hkv, D] raw
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    norm: QKNormRope

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache.clone(), self.v_cache.clone()


def decode_step(device, cache_dtype=torch.bfloat16, context_lens=(9, 0, 30, 1)) -> DecodeStep:
    """Raw q/k/v of one decode step over a paged cache (bf16, or FP8 made from it), with the
    layer's norm and MRoPE: positions whose t, h and w rows differ, so every section counts."""
    generator = torch.Generator().manual_seed(0)
    paged = build_paged_kv(list(context_lens), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, device)
    slots = [-1 if n == 0 else int(paged.block_tables[b, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
             for b, n in enumerate(context_lens)]
    batch = len(context_lens)

    def raw(heads: int) -> torch.Tensor:
        return (3 * torch.randn(batch, heads, HEAD_DIM, generator=generator)).to(torch.bfloat16).to(device)

    def weight() -> torch.Tensor:
        return (1 + 0.3 * torch.randn(HEAD_DIM, generator=generator)).to(torch.bfloat16).to(device)

    norm = QKNormRope(weight(), weight(), torch.randint(0, 3000, (3, batch), generator=generator).to(device),
                      (1.0 / 5e6 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)).to(device), SECTION, 1e-6)
    return DecodeStep(raw(NUM_Q_HEADS), raw(NUM_KV_HEADS), raw(NUM_KV_HEADS), paged.k_cache.to(cache_dtype),
                      paged.v_cache.to(cache_dtype), torch.tensor(slots, device=device), paged.block_tables,
                      paged.context_lens, norm)


def run_fused(step: DecodeStep, caches, **options) -> torch.Tensor:
    return paged_decode_attention_with_kv_write_triton(
        step.q, step.k, step.v, *caches, step.slots, step.block_tables, step.context_lens, 0.2,
        qk_norm_rope=step.norm, **options)


def run_separately(step: DecodeStep, caches, **options) -> torch.Tensor:
    """qk_norm_mrope first (its reference: what the Triton kernel of that op computes too), then
    the kernel on the normed q and k."""
    norm = step.norm
    q, k = qk_norm_mrope_reference(step.q, step.k, norm.q_weight, norm.k_weight, norm.positions, norm.inv_freq,
                                   norm.mrope_section, norm.eps)
    return paged_decode_attention_with_kv_write_triton(
        q, k, step.v, *caches, step.slots, step.block_tables, step.context_lens, 0.2, **options)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_the_fused_kernel_matches_the_norm_then_the_kernel(triton_device, cache_dtype, num_splits):
    # tolerance: 2e-2 relative on the output, and the written K at most one step of the cache's
    # dtype apart (bfloat16 math: the fused norm sums a head's squares in another order than
    # qk_norm_mrope, which can move a value by one rounding step)
    step = decode_step(triton_device, cache_dtype)
    fused_caches, separate_caches = step.caches(), step.caches()
    out = run_fused(step, fused_caches, num_splits=num_splits)
    expected = run_separately(step, separate_caches, num_splits=num_splits)
    assert_close(out.float(), expected.float(), rel=2e-2)
    written = step.slots[step.slots >= 0]
    for fused, separate in zip(fused_caches, separate_caches):
        flat_fused, flat_separate = (c.view(-1, NUM_KV_HEADS, HEAD_DIM)[written].float() for c in (fused, separate))
        step_size = flat_separate.abs().clamp_min(2**-6) * (2**-3 if cache_dtype == torch.float8_e4m3fn else 2**-7)
        assert ((flat_fused - flat_separate).abs() <= step_size).all()
    untouched = torch.ones(step.k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM).shape[0], dtype=torch.bool)
    untouched[written.cpu()] = False  # every other slot as it was (the unused ones hold NaN)
    for cache, before in zip(fused_caches, (step.k_cache, step.v_cache)):
        torch.testing.assert_close(cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[untouched.to(triton_device)].float(),
                                   before.view(-1, NUM_KV_HEADS, HEAD_DIM)[untouched.to(triton_device)].float(),
                                   rtol=0, atol=0, equal_nan=True)


def test_without_the_norm_the_output_differs(triton_device):
    """The comparison above can fail: attending with the raw q and k gives another answer."""
    step = decode_step(triton_device)
    raw = paged_decode_attention_with_kv_write_triton(
        step.q, step.k, step.v, *step.caches(), step.slots, step.block_tables, step.context_lens, 0.2)
    normed = run_fused(step, step.caches())
    assert (raw.float() - normed.float()).abs().max() > 0.1


def test_the_dispatch_fuses_on_triton_and_applies_the_norm_first_elsewhere(triton_device, monkeypatch):
    """Through `paged_decode_attention_with_kv_write`: the Triton path fuses (or, with
    decode_qk_norm_rope off, runs qk_norm_mrope's launch first), the CPU reference path norms
    first; all three give the same answer. Tolerance: 2e-2 relative (bfloat16)."""
    step = decode_step(triton_device)
    arguments = (step.q, step.k, step.v)
    rest = (step.slots, step.block_tables, step.context_lens, 0.2)
    assert fuses_qk_norm_rope(step.norm, step.q, step.k)
    fused = paged_decode_attention_with_kv_write(*arguments, *step.caches(), *rest, qk_norm_rope=step.norm)
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "decode_qk_norm_rope")
    assert not fuses_qk_norm_rope(step.norm, step.q, step.k)
    separate = paged_decode_attention_with_kv_write(*arguments, *step.caches(), *rest, qk_norm_rope=step.norm)
    monkeypatch.setenv("VLM_CATALOG_KERNELS", "reference")
    monkeypatch.delenv("VLM_CATALOG_KERNELS_OFF")
    reference = paged_decode_attention_with_kv_write(*arguments, *step.caches(), *rest, qk_norm_rope=step.norm)
    assert_close(fused.float(), separate.float(), rel=2e-2)
    assert_close(fused.float(), reference.float(), rel=2e-2)


def test_weights_that_would_promote_q_are_applied_apart(triton_device):
    """qk_norm_mrope's outputs take the weights' dtype when it is wider (float32 weights, bf16 q):
    the kernel, which keeps q's dtype, is not asked to fuse then."""
    step = decode_step(triton_device)
    wide = QKNormRope(step.norm.q_weight.float(), step.norm.k_weight.float(), step.norm.positions,
                      step.norm.inv_freq, SECTION, 1e-6)
    assert not fuses_qk_norm_rope(wide, step.q, step.k)
    with pytest.raises(ValueError, match="would promote"):
        paged_decode_attention_with_kv_write_triton(step.q, step.k, step.v, *step.caches(), step.slots,
                                                    step.block_tables, step.context_lens, 0.2, qk_norm_rope=wide)


@pytest.mark.gpu
@pytest.mark.fast_path("decode_qk_norm_rope")
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_fused_norm_rope_at_the_model_shapes(cuda_device, cache_dtype):
    # tolerance: 2e-2 relative (bfloat16), as on CPU; 32 query heads over 4 KV heads of 128, the
    # model's MRoPE sections, 64 sequences of up to ~2000 cached tokens, split and not

    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 2000, (64,), generator=generator).tolist()
    paged = build_paged_kv(lengths, 16, 4, 128, torch.bfloat16, cuda_device)
    slots = [int(paged.block_tables[b, (n - 1) // 16]) * 16 + (n - 1) % 16 for b, n in enumerate(lengths)]

    def raw(heads):
        return (3 * torch.randn(64, heads, 128, generator=generator)).to(torch.bfloat16).to(cuda_device)

    norm = QKNormRope((1 + 0.3 * torch.randn(128, generator=generator)).to(torch.bfloat16).to(cuda_device),
                      (1 + 0.3 * torch.randn(128, generator=generator)).to(torch.bfloat16).to(cuda_device),
                      torch.randint(0, 30000, (3, 64), generator=generator).to(cuda_device),
                      (1.0 / 5e6 ** (torch.arange(0, 128, 2).float() / 128)).to(cuda_device), (24, 20, 20), 1e-6)
    step = DecodeStep(raw(32), raw(4), raw(4), paged.k_cache.to(cache_dtype), paged.v_cache.to(cache_dtype),
                      torch.tensor(slots, device=cuda_device), paged.block_tables, paged.context_lens, norm)
    for options in ({"max_context_len": 32768}, {"num_splits": 1}):
        out = run_fused(step, step.caches(), **options)
        assert_close(out.float(), run_separately(step, step.caches(), **options).float(), rel=2e-2)
