"""Per-head QK RMSNorm followed by interleaved multimodal RoPE (Qwen3-VL).

Matches transformers' `Qwen3VLMoeTextAttention` (q_norm / k_norm) +
`Qwen3VLMoeTextRotaryEmbedding` + `apply_rotary_pos_emb`:

* ``freqs[a] = positions[a, :, None].float() * inv_freq`` for the axes (t, h, w)
  -> [3, T, D/2];
* start from the t-axis freqs; dims 1, 4, 7, ... below ``3 * s_h`` take the
  h-axis freqs, dims 2, 5, 8, ... below ``3 * s_w`` the w-axis freqs;
* ``emb = cat(freqs, freqs)`` -> [T, D]; cos/sin are cast to the input dtype;
* ``out = x * cos + rotate_half(x) * sin``.

Text-only tokens carry the same position on all three rows, which reduces this
to ordinary 1-D RoPE.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kernels.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dtype,
    check_same_device,
    check_shape,
    check_unit_stride_last_dim,
)
from kernels.dispatch import use_triton
from kernels.launch_math import next_power_of_2
from kernels.pdl import launch_options
from kernels.rms_norm import rms_norm_reference
from kernels.strides import common_power_of_two

MRopeSection = Sequence[int]  # (s_t, s_h, s_w), with s_t + s_h + s_w == D // 2


def _as_three_rows(positions: torch.Tensor) -> torch.Tensor:
    """[T] (text only) or [3, T] -> [3, T]."""
    if positions.dim() == 1:
        return positions.unsqueeze(0).expand(3, -1)  # [3, T]
    return positions


# --------------------------------------------------------------------------- reference
def mrope_cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: MRopeSection,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [3, T] int, inv_freq [D/2] -> (cos [T, D], sin [T, D]) in `dtype`."""
    positions = _as_three_rows(positions)
    freqs = positions[..., None].float() * inv_freq.float()  # [3, T, D/2]
    interleaved = freqs[0].clone()  # [T, D/2], t-axis everywhere to start with
    for axis in (1, 2):  # h, w
        dims = slice(axis, mrope_section[axis] * 3, 3)
        interleaved[:, dims] = freqs[axis, :, dims]
    emb = torch.cat((interleaved, interleaved), dim=-1)  # [T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def qk_norm_mrope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: MRopeSection,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] -> (q_out, k_out), same shapes."""
    cos, sin = mrope_cos_sin(positions, inv_freq, mrope_section, q.dtype)
    cos = cos.unsqueeze(1)  # [T, 1, D]
    sin = sin.unsqueeze(1)  # [T, 1, D]
    q_normed = rms_norm_reference(q, q_weight, eps)
    k_normed = rms_norm_reference(k, k_weight, eps)
    q_out = (q_normed * cos) + (rotate_half(q_normed) * sin)
    k_out = (k_normed * cos) + (rotate_half(k_normed) * sin)
    return q_out, k_out


# --------------------------------------------------------------------------- triton
def qk_norm_mrope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: MRopeSection,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch: per token, normalise and rotate all q and k heads (cos/sin computed inline)."""

    from kernels.jit.rotary import qk_norm_mrope_kernel

    positions = check_qk_norm_mrope_args(q, k, QKNormRope(q_weight, k_weight, positions, inv_freq, mrope_section,
                                                          eps))
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]

    q_out = torch.empty(
        q.shape, dtype=torch.promote_types(q_weight.dtype, q.dtype), device=q.device
    )
    k_out = torch.empty(
        k.shape, dtype=torch.promote_types(k_weight.dtype, k.dtype), device=k.device
    )
    if num_tokens == 0:
        return q_out, k_out
    qk_norm_mrope_kernel[(num_tokens,)](
        # pointers
        q,
        k,
        q_weight,
        k_weight,
        positions,
        inv_freq,
        q_out,
        k_out,
        # sizes
        num_q_heads,
        num_kv_heads,
        eps,
        # strides
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        positions.stride(0),
        positions.stride(1),
        # meta-parameters
        HEAD_DIM=head_dim,
        BLOCK_HALF=next_power_of_2(head_dim // 2),
        BLOCK_Q_HEADS=next_power_of_2(num_q_heads),
        BLOCK_KV_HEADS=next_power_of_2(num_kv_heads),
        SECTION_H=mrope_section[1],
        SECTION_W=mrope_section[2],
        HEAD_STRIDE_MULTIPLE=common_power_of_two(
            (q.stride(1), k.stride(1), q_out.stride(1), k_out.stride(1))),
        num_warps=4,
        **launch_options(q),
    )
    return q_out, k_out


def check_qk_norm_mrope_args(q: torch.Tensor, k: torch.Tensor, norm: QKNormRope) -> torch.Tensor:
    """What the Triton kernels that norm and rotate q/k take (a clear error otherwise); returns
    the positions as [3, T]."""
    q_weight, k_weight, inv_freq, mrope_section = norm.q_weight, norm.k_weight, norm.inv_freq, norm.mrope_section
    check_shape("q", q, (None, None, None))
    num_tokens, _, head_dim = q.shape
    check_shape("k", k, (num_tokens, None, head_dim))
    if head_dim % 2:
        raise ValueError(f"q: head_dim must be even for RoPE, got {head_dim}")
    check_shape("q_weight", q_weight, (head_dim,))
    check_shape("k_weight", k_weight, (head_dim,))
    positions = _as_three_rows(norm.positions)
    check_shape("positions", positions, (3, num_tokens))
    check_shape("inv_freq", inv_freq, (head_dim // 2,))
    if len(mrope_section) != 3 or sum(mrope_section) != head_dim // 2 or min(mrope_section) < 0:
        raise ValueError(
            f"mrope_section: expected 3 sections, none negative, summing to head_dim // 2 = {head_dim // 2}, "
            f"got {tuple(mrope_section)}"
        )
    for name, tensor in (("q", q), ("k", k), ("q_weight", q_weight), ("k_weight", k_weight)):
        check_dtype(name, tensor, FLOAT_DTYPES)
        check_unit_stride_last_dim(name, tensor)
    check_dtype("positions", positions, INDEX_DTYPES)
    check_dtype("inv_freq", inv_freq, (torch.float32,))
    check_unit_stride_last_dim("inv_freq", inv_freq)
    check_same_device(
        q=q, k=k, q_weight=q_weight, k_weight=k_weight, positions=positions, inv_freq=inv_freq
    )
    return positions


# --------------------------------------------------------------------------- dispatch
def qk_norm_mrope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: MRopeSection,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm + interleaved MRoPE for q [T, Hq, D] and k [T, Hkv, D].

    positions must be integers on both paths (the Triton kernel reads them as
    integers); checking here keeps CPU runs as strict as GPU runs.
    """
    check_dtype("positions", positions, INDEX_DTYPES)
    if use_triton(q, k, q_weight, k_weight, positions, inv_freq, op="qk_norm_mrope"):
        return qk_norm_mrope_triton(
            q, k, q_weight, k_weight, positions, inv_freq, mrope_section, eps
        )
    return qk_norm_mrope_reference(
        q, k, q_weight, k_weight, positions, inv_freq, mrope_section, eps
    )


@dataclass(frozen=True)
class QKNormRope:
    """`qk_norm_mrope`'s arguments besides q and k: what a layer does to a step's q and k before
    attention. An attention kernel that reads the raw q and k can apply it itself and save that
    launch (`paged_decode_attention_with_kv_write`); calling it applies it on its own."""

    q_weight: torch.Tensor  # [D]
    k_weight: torch.Tensor  # [D]
    positions: torch.Tensor  # [3, T] int (or [T]: text only)
    inv_freq: torch.Tensor  # [D/2] float32
    mrope_section: MRopeSection
    eps: float

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return qk_norm_mrope(q, k, self.q_weight, self.k_weight, self.positions, self.inv_freq,
                             self.mrope_section, self.eps)

    def rows(self, start: int, stop: int) -> QKNormRope:
        """The same for tokens start:stop of the step."""
        return replace(self, positions=_as_three_rows(self.positions)[:, start:stop])

    def keeps_dtypes(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether its outputs have q's and k's own dtypes (`qk_norm_mrope` promotes to the weights')."""
        return (torch.promote_types(self.q_weight.dtype, q.dtype) == q.dtype
                and torch.promote_types(self.k_weight.dtype, k.dtype) == k.dtype)

