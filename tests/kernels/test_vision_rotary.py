"""vision_rotary: reference vs transformers, Triton vs reference, argument checks."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.vision_rotary import vision_rotary_reference, vision_rotary_triton
from tests.kernels.helpers import TOLERANCE, assert_close

VISION_LIKE = [(7, 3, 24), (5, 16, 72)]  # (patches, heads, head_dim); 72 is 30B-A3B's, not a power of two


def vision_angles(num_patches: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, D] float32 shaped like the tower's: row and column angles, repeated twice."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float) / (head_dim // 2)))
    rows = torch.randint(0, 64, (num_patches,)).float()[:, None] * inv_freq  # [N, D/4]
    cols = torch.randint(0, 64, (num_patches,)).float()[:, None] * inv_freq
    half = torch.cat([rows, cols], dim=-1)  # [N, D/2]
    angles = torch.cat([half, half], dim=-1)  # [N, D]
    return angles.cos(), angles.sin()


def qkv_views(num_patches: int, heads: int, head_dim: int, dtype, device):
    """q, k as the tower passes them: strided slices of one fused projection [N, 3, H, D]."""
    qkv = torch.randn(num_patches, 3, heads, head_dim).to(dtype).to(device)
    q, k, _ = qkv.unbind(dim=1)  # each [N, H, D], token stride 3 * H * D
    return q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_transformers(dtype):
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import apply_rotary_pos_emb_vision

    q, k = qkv_views(9, 4, 24, dtype, "cpu")
    cos, sin = vision_angles(9, 24)
    expected_q, expected_k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    actual_q, actual_k = vision_rotary_reference(q, k, cos, sin)
    torch.testing.assert_close(actual_q, expected_q, rtol=0, atol=0)
    torch.testing.assert_close(actual_k, expected_k, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", VISION_LIKE)
def test_triton_matches_reference(triton_device, poison_allocations, dtype, shape):
    # tolerance: TOLERANCE[dtype] (float32 1e-4, 16-bit 1e-2); both round once from float32
    num_patches, heads, head_dim = shape
    q, k = qkv_views(num_patches, heads, head_dim, dtype, triton_device)
    cos, sin = (t.to(triton_device) for t in vision_angles(num_patches, head_dim))
    expected_q, expected_k = vision_rotary_reference(q, k, cos, sin)
    actual_q, actual_k = kernels.vision_rotary(q, k, cos, sin)
    for actual, expected, name in ((actual_q, expected_q, "q"), (actual_k, expected_k, "k")):
        assert actual.dtype == dtype and actual.is_contiguous()
        assert_close(actual, expected, rel=TOLERANCE[dtype], what=name)


def test_triton_uses_both_halves_of_cos_and_sin(triton_device):
    # the tower's halves are equal; the kernel must still read each half where it applies
    q, k = qkv_views(4, 2, 8, torch.float32, triton_device)
    cos, sin = torch.rand(4, 8, device=triton_device), torch.rand(4, 8, device=triton_device)
    for actual, expected in zip(vision_rotary_triton(q, k, cos, sin), vision_rotary_reference(q, k, cos, sin)):
        assert_close(actual, expected, rel=TOLERANCE[torch.float32])


def test_triton_no_patches(triton_device):
    q, k = qkv_views(0, 2, 8, torch.bfloat16, triton_device)
    cos = sin = torch.zeros(0, 8, device=triton_device)
    out_q, out_k = vision_rotary_triton(q, k, cos, sin)
    assert out_q.shape == out_k.shape == (0, 2, 8)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, k, cos, sin: (q[..., :7], k[..., :7], cos[:, :7], sin[:, :7]), "even"),
        (lambda q, k, cos, sin: (q, k[:, :1], cos, sin), "k: expected shape"),
        (lambda q, k, cos, sin: (q, k, cos[:3], sin), "cos: expected shape"),
        (lambda q, k, cos, sin: (q, k, cos, sin.half()), "sin: dtype"),
        (lambda q, k, cos, sin: (q, k.half(), cos, sin), "differs from q"),
        (lambda q, k, cos, sin: (q.transpose(1, 2).contiguous().transpose(1, 2), k, cos, sin), "contiguous"),
    ],
)
def test_triton_rejects_bad_arguments(triton_device, change, message):
    q, k = qkv_views(4, 2, 8, torch.float32, triton_device)
    cos, sin = (t.to(triton_device) for t in vision_angles(4, 8))
    with pytest.raises(ValueError, match=message):
        vision_rotary_triton(*change(q, k, cos, sin))


def test_cpu_dispatch_is_the_reference():
    q, k = qkv_views(6, 2, 8, torch.bfloat16, "cpu")
    cos, sin = vision_angles(6, 8)
    for actual, expected in zip(kernels.vision_rotary(q, k, cos, sin), vision_rotary_reference(q, k, cos, sin)):
        assert torch.equal(actual, expected)


@pytest.mark.gpu
def test_gpu_vision_rotary(cuda_device):
    q, k = qkv_views(65536, 16, 72, torch.bfloat16, cuda_device)  # 30B-A3B's vision heads
    cos, sin = (t.to(cuda_device) for t in vision_angles(65536, 72))
    for actual, expected in zip(kernels.vision_rotary(q, k, cos, sin), vision_rotary_reference(q, k, cos, sin)):
        assert_close(actual, expected, rel=1e-2)
