"""qk_norm_mrope / mrope_cos_sin: reference vs transformers, Triton vs reference."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.rms_norm import rms_norm_reference
from kernels.rotary import mrope_cos_sin, qk_norm_mrope_reference, qk_norm_mrope_triton
from tests.kernels.helpers import TOLERANCE, assert_close

EPS = 1e-6


def inv_freq_for(head_dim: int, theta: float = 5e6) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def transformers_rotary(head_dim: int, mrope_section: list[int]):
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextRotaryEmbedding

    config = Qwen3VLMoeTextConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5e6,
            "mrope_section": mrope_section,
            "mrope_interleaved": True,
        },
    )
    return Qwen3VLMoeTextRotaryEmbedding(config)


def vision_like_positions(num_tokens: int) -> torch.Tensor:
    """[3, T]: text tokens (equal rows) around an image block with distinct h/w rows."""
    positions = torch.arange(num_tokens).repeat(3, 1)
    image = slice(2, num_tokens - 1)
    count = image.stop - image.start
    positions[1, image] = 2 + torch.arange(count) // 3
    positions[2, image] = 2 + torch.arange(count) % 3
    return positions + 1000  # large positions exercise the float32 angle path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cos_sin_match_transformers(dtype):
    rotary = transformers_rotary(32, [6, 5, 5])
    positions = vision_like_positions(11)
    x = torch.zeros(1, dtype=dtype)
    expected_cos, expected_sin = rotary(x, positions[:, None, :])  # position_ids [3, bs=1, T]
    cos, sin = mrope_cos_sin(positions, rotary.inv_freq, (6, 5, 5), dtype)
    torch.testing.assert_close(cos, expected_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, expected_sin[0], rtol=0, atol=0)


def test_reference_matches_transformers_attention_prologue():
    """q_norm/k_norm + apply_rotary_pos_emb exactly as Qwen3VLMoeTextAttention does them."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import apply_rotary_pos_emb

    head_dim, section = 32, [6, 5, 5]
    rotary = transformers_rotary(head_dim, section)
    positions = vision_like_positions(9)
    q, k = torch.randn(9, 4, head_dim), torch.randn(9, 2, head_dim)
    q_weight, k_weight = torch.randn(head_dim), torch.randn(head_dim)
    cos, sin = rotary(q, positions[:, None, :])  # [1, T, D]
    q_states = rms_norm_reference(q, q_weight, EPS).transpose(0, 1)[None]  # [1, Hq, T, D]
    k_states = rms_norm_reference(k, k_weight, EPS).transpose(0, 1)[None]  # [1, Hkv, T, D]
    expected_q, expected_k = apply_rotary_pos_emb(q_states, k_states, cos, sin)
    q_out, k_out = qk_norm_mrope_reference(
        q, k, q_weight, k_weight, positions, rotary.inv_freq, section, EPS
    )
    torch.testing.assert_close(q_out, expected_q[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(k_out, expected_k[0].transpose(0, 1), rtol=0, atol=0)


def test_text_positions_reduce_to_plain_rope_float64():
    # independent float64 re-computation of 1-D RoPE; tolerance 1e-5 relative (float32 angles ~1e3)
    head_dim, num_tokens = 16, 6
    positions = torch.arange(num_tokens) * 37 + 5
    inv_freq = inv_freq_for(head_dim)
    q, k = torch.randn(num_tokens, 2, head_dim), torch.randn(num_tokens, 1, head_dim)
    ones = torch.ones(head_dim)
    q_out, _ = qk_norm_mrope_reference(
        q, k, ones, ones, positions.repeat(3, 1), inv_freq, (4, 2, 2), EPS
    )

    q64 = q.double() / torch.sqrt(q.double().pow(2).mean(-1, keepdim=True) + EPS)
    angle = positions.double()[:, None] * inv_freq.double()[None, :]  # [T, D/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    first, second = q64[..., : head_dim // 2], q64[..., head_dim // 2 :]
    expected = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    assert_close(q_out, expected, rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "num_tokens,num_q_heads,num_kv_heads,head_dim,section",
    [
        (1, 2, 2, 16, (4, 2, 2)),
        (9, 8, 2, 32, (6, 5, 5)),
        (4, 5, 1, 24, (4, 4, 4)),
        (3, 32, 4, 128, (24, 20, 20)),
    ],
)
def test_triton_qk_norm_mrope(
    triton_device,
    poison_allocations,
    dtype,
    num_tokens,
    num_q_heads,
    num_kv_heads,
    head_dim,
    section,
):
    # tolerance: TOLERANCE[dtype] (float32 1e-4, 16-bit 1e-2), max-norm relative
    q = torch.randn(num_tokens, num_q_heads, head_dim).to(dtype).to(triton_device)
    k = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype).to(triton_device)
    q_weight = torch.randn(head_dim).to(dtype).to(triton_device)
    k_weight = torch.randn(head_dim).to(dtype).to(triton_device)
    positions = (
        vision_like_positions(max(num_tokens, 3))[:, :num_tokens].contiguous().to(triton_device)
    )
    inv_freq = inv_freq_for(head_dim).to(triton_device)
    q_out, k_out = kernels.qk_norm_mrope(
        q, k, q_weight, k_weight, positions, inv_freq, section, EPS
    )
    expected_q, expected_k = qk_norm_mrope_reference(
        q, k, q_weight, k_weight, positions, inv_freq, section, EPS
    )
    assert_close(q_out, expected_q, rel=TOLERANCE[dtype], what="q")
    assert_close(k_out, expected_k, rel=TOLERANCE[dtype], what="k")


def test_triton_strided_q_and_text_positions(triton_device):
    """q/k as views into a fused qkv projection output, and [T] text positions."""
    num_tokens, head_dim = 5, 32
    qkv = torch.randn(num_tokens, (4 + 2 + 2) * head_dim, device=triton_device)
    q = qkv[:, : 4 * head_dim].view(num_tokens, 4, head_dim)  # [T, Hq, D], row stride 8 * D
    k = qkv[:, 4 * head_dim : 6 * head_dim].view(num_tokens, 2, head_dim)  # [T, Hkv, D]
    weights = (
        torch.randn(head_dim, device=triton_device),
        torch.randn(head_dim, device=triton_device),
    )
    positions = torch.arange(num_tokens, device=triton_device) + 3
    inv_freq = inv_freq_for(head_dim).to(triton_device)
    got = qk_norm_mrope_triton(q, k, *weights, positions, inv_freq, (6, 5, 5), EPS)
    expected = qk_norm_mrope_reference(q, k, *weights, positions, inv_freq, (6, 5, 5), EPS)
    for actual, wanted in zip(got, expected):
        assert_close(actual, wanted, rel=1e-4)


def test_triton_wrapper_rejects_bad_arguments(triton_device):
    q, k = torch.randn(3, 4, 16, device=triton_device), torch.randn(3, 2, 16, device=triton_device)
    w = torch.randn(16, device=triton_device)
    positions = torch.zeros(3, 3, dtype=torch.long, device=triton_device)
    inv_freq = inv_freq_for(16).to(triton_device)
    with pytest.raises(ValueError, match="mrope_section"):
        qk_norm_mrope_triton(q, k, w, w, positions, inv_freq, (4, 4, 4), EPS)
    with pytest.raises(ValueError, match="none negative"):  # sums to 8, but was computed wrongly
        qk_norm_mrope_triton(q, k, w, w, positions, inv_freq, (10, -1, -1), EPS)
    with pytest.raises(ValueError, match="positions"):
        qk_norm_mrope_triton(q, k, w, w, positions[:, :2], inv_freq, (4, 2, 2), EPS)
    with pytest.raises(ValueError, match="inv_freq"):
        qk_norm_mrope_triton(q, k, w, w, positions, inv_freq.double(), (4, 2, 2), EPS)
    with pytest.raises(ValueError, match="k"):
        qk_norm_mrope_triton(q, k[:2], w, w, positions, inv_freq, (4, 2, 2), EPS)


@pytest.mark.gpu
def test_gpu_qk_norm_mrope_model_shapes(cuda_device):
    # tolerance: 1e-2 (bfloat16); positions up to 27k as in the longest prompts
    num_tokens = 8192
    q = torch.randn(num_tokens, 32, 128, device=cuda_device, dtype=torch.bfloat16)
    k = torch.randn(num_tokens, 4, 128, device=cuda_device, dtype=torch.bfloat16)
    q_weight = torch.randn(128, device=cuda_device, dtype=torch.bfloat16)
    k_weight = torch.randn(128, device=cuda_device, dtype=torch.bfloat16)
    positions = torch.randint(0, 27000, (3, num_tokens), device=cuda_device)
    inv_freq = inv_freq_for(128).to(cuda_device)
    got = kernels.qk_norm_mrope(q, k, q_weight, k_weight, positions, inv_freq, (24, 20, 20), EPS)
    expected = qk_norm_mrope_reference(
        q, k, q_weight, k_weight, positions, inv_freq, (24, 20, 20), EPS
    )
    for actual, wanted in zip(got, expected):
        assert_close(actual, wanted, rel=1e-2)
