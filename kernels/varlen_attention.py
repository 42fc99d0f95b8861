"""Non-causal attention within packed segments: q, k, v [N, H, D], segment i =
rows ``cu_seqlens[i]:cu_seqlens[i+1]`` (vision tower: each image attends only to
itself).

Backends on CUDA: the Triton kernel, or per-segment `F.scaled_dot_product_attention`
(which runs FlashAttention on CUDA and is strong on a few long segments, but
pays a launch and a host sync per segment). `VLM_CATALOG_VARLEN_ATTENTION`
(``auto`` | ``triton`` | ``sdpa``) picks one; ``auto`` uses SDPA for at most
`SDPA_MAX_SEGMENTS` segments and Triton above. That threshold is a placeholder
until `scripts/bench_kernels.py` measures both on a GPU (it prints the timings
per segment count; set the constant from them). `VLM_CATALOG_KERNELS` still
wins: ``reference`` forces SDPA, ``triton`` forces the kernel.
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.nn.functional as F

from kernels.attention_common import LOG2_E, dot_precision
from kernels.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dtype,
    check_same_device,
    check_shape,
    check_unit_stride_last_dim,
)
from kernels.dispatch import kernel_backend, use_triton

VARLEN_BACKEND_ENV_VAR = "VLM_CATALOG_VARLEN_ATTENTION"
SDPA_MAX_SEGMENTS = 8  # NOT YET MEASURED: placeholder, see the module docstring


# --------------------------------------------------------------------------- reference
def varlen_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Per-segment SDPA, as transformers' vision attention does without flash-attn."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for begin, end in itertools.pairwise(bounds):
        if end == begin:
            continue
        context = F.scaled_dot_product_attention(
            q[begin:end].transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
            k[begin:end].transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
            v[begin:end].transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
            scale=scale,
        )  # [1, H, n, D]
        out[begin:end] = context[0].transpose(0, 1)  # [n, H, D]
    return out


# --------------------------------------------------------------------------- triton
def varlen_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """`max_seqlen`: optional host-side longest segment (otherwise computed: a device sync)."""
    import triton

    from kernels.jit.varlen_attention import varlen_attention_kernel

    check_shape("q", q, (None, None, None))
    check_shape("k", k, tuple(q.shape))
    check_shape("v", v, tuple(q.shape))
    check_shape("cu_seqlens", cu_seqlens, (None,))
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        check_dtype(name, tensor, FLOAT_DTYPES)
        check_unit_stride_last_dim(name, tensor)
    check_dtype("k", k, (q.dtype,))
    check_dtype("v", v, (q.dtype,))
    check_dtype("cu_seqlens", cu_seqlens, INDEX_DTYPES)
    check_same_device(q=q, k=k, v=v, cu_seqlens=cu_seqlens)
    if cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens: expected at least one entry ([n + 1] segment bounds)")

    num_tokens, num_heads, head_dim = q.shape
    num_segments = cu_seqlens.shape[0] - 1
    out = torch.empty_like(q)
    if num_tokens == 0 or num_segments == 0:
        return out
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    block_m = 64 if max_seqlen > 32 else 16
    grid = (triton.cdiv(max(max_seqlen, 1), block_m), num_segments, num_heads)
    varlen_attention_kernel[grid](
        # pointers
        q,
        k,
        v,
        cu_seqlens,
        out,
        # sizes
        scale * LOG2_E,
        # strides
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        # meta-parameters
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=64 if head_dim <= 128 else 32,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4,
        num_stages=2,
    )
    return out


# --------------------------------------------------------------------------- dispatch
def varlen_backend(num_segments: int) -> str:
    """ "triton" or "sdpa" for a CUDA call with `num_segments` segments."""
    choice = os.environ.get(VARLEN_BACKEND_ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in ("auto", "triton", "sdpa"):
        raise ValueError(f"{VARLEN_BACKEND_ENV_VAR}={choice!r} is not one of auto, triton, sdpa")
    if choice == "auto":
        return "sdpa" if num_segments <= SDPA_MAX_SEGMENTS else "triton"
    return choice


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """q, k, v [N, H, D], cu_seqlens [n+1] -> [N, H, D]; non-causal within each segment."""
    if use_triton(q, k, v, cu_seqlens):
        forced = kernel_backend() == "triton"
        if forced or varlen_backend(cu_seqlens.shape[0] - 1) == "triton":
            return varlen_attention_triton(q, k, v, cu_seqlens, scale, max_seqlen=max_seqlen)
    return varlen_attention_reference(q, k, v, cu_seqlens, scale)
