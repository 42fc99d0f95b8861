"""2D rotary embedding of the vision tower's q and k (Qwen3-VL).

Matches transformers' `apply_rotary_pos_emb_vision`: q and k are taken to
float32, ``out = x * cos + rotate_half(x) * sin`` with float32 cos/sin [N, D]
(the same angles for every head), and the result is rounded back to the input
dtype once.

The torch reference makes about ten full passes over q and k in float32 (the
casts, the halves' concatenation, two products, the sum, the cast back); the
Triton kernel reads each of q and k once and writes each once. At the 30B-A3B
vision width (16 heads of 72, 27 layers) q and k are 2,304 bytes per patch each
in bf16; for the 109k patches of 32 benchmark-sized images that is about 350 GB
of memory traffic against 27 GB (about 0.1 s against 0.01 s on an H100).

q and k may be strided views (the tower passes the q and k slices of its fused
qkv projection); the outputs are new contiguous [N, H, D] tensors.
"""

from __future__ import annotations

import torch

from kernels.checks import (
    FLOAT_DTYPES,
    check_dtype,
    check_same_device,
    check_shape,
    check_unit_stride_last_dim,
)
from kernels.dispatch import use_triton
from kernels.launch_math import next_power_of_2
from kernels.pdl import launch_options
from kernels.rotary import rotate_half
from kernels.strides import common_power_of_two


# --------------------------------------------------------------------------- reference
def vision_rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [N, H, D], cos, sin [N, D] -> rotated (q, k) [N, H, D] in the input dtype."""
    cos, sin = cos[:, None, :].float(), sin[:, None, :].float()  # [N, 1, D]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)

    return rotate(q), rotate(k)


# --------------------------------------------------------------------------- triton
def vision_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch, one program per patch: every head of q and k rotated."""

    from kernels.jit.vision_rotary import vision_rotary_kernel

    check_shape("q", q, (None, None, None))
    num_patches, num_heads, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"q: head_dim must be even for rotary embeddings, got {head_dim}")
    check_shape("k", k, (num_patches, num_heads, head_dim))
    check_shape("cos", cos, (num_patches, head_dim))
    check_shape("sin", sin, (num_patches, head_dim))
    for name, tensor in (("q", q), ("k", k)):
        check_dtype(name, tensor, FLOAT_DTYPES)
    for name, tensor in (("cos", cos), ("sin", sin)):
        check_dtype(name, tensor, (torch.float32,))
    for name, tensor in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_unit_stride_last_dim(name, tensor)
    check_same_device(q=q, k=k, cos=cos, sin=sin)
    if k.dtype != q.dtype:
        raise ValueError(f"k: dtype {k.dtype} differs from q's {q.dtype}")

    q_out = torch.empty((num_patches, num_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty_like(q_out)
    if num_patches == 0:
        return q_out, k_out
    vision_rotary_kernel[(num_patches,)](
        # pointers
        q,
        k,
        cos,
        sin,
        q_out,
        k_out,
        # sizes
        num_heads,
        # strides
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        q_out.stride(0),
        q_out.stride(1),
        # meta-parameters
        HEAD_DIM=head_dim,
        BLOCK_HALF=next_power_of_2(head_dim // 2),
        BLOCK_HEADS=next_power_of_2(num_heads),
        STRIDE_MULTIPLE=common_power_of_two((q.stride(1), k.stride(1), q_out.stride(1), cos.stride(0), sin.stride(0))),
        num_warps=4,
        **launch_options(q),
    )
    return q_out, k_out


# --------------------------------------------------------------------------- dispatch
def vision_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q, k [N, H, D] by per-patch angles (cos, sin [N, D] float32)."""
    if use_triton(q, k, cos, sin, op="vision_rotary"):
        return vision_rotary_triton(q, k, cos, sin)
    return vision_rotary_reference(q, k, cos, sin)
