"""Non-causal attention within packed segments: q, k, v [N, H, D], segment i =
rows ``cu_seqlens[i]:cu_seqlens[i+1]`` (vision tower: each image attends only to
itself).

Backends on CUDA. For 16-bit inputs with a head size FlashAttention takes, and
every segment shorter than `SDPA_MIN_SEGMENT_LEN` rows: PyTorch's FlashAttention
varlen kernel (`kernels.flash_varlen`), all segments in one launch with nothing
copied; with FlashAttention 3 there (the default on Hopper GPUs where it is installed), every call,
long segments too. Otherwise, per segment: `F.scaled_dot_product_attention` (FlashAttention
too, one launch per segment) for segments of at least `SDPA_MIN_SEGMENT_LEN`
rows, and one Triton launch for all the shorter ones (the kernel skips the long
segments, so the two write disjoint rows). Measured on an H100 (bf16, 16 heads
of 72, 2026-11-25, docs/results/gpu/bench_gpu_2026-11-25.json): per-segment SDPA against
the varlen kernel / the Triton kernel is 0.46x / 0.45x at 8 x 1024 patches,
1.38x / 1.72x at 4 x 4096 and 1.32x / 1.60x at 1 x 15625; the threshold, 2048,
lies between, and a call with one long image takes the per-segment path, where
the long segments carry most of the work (attention grows with the square of
the segment).
If the varlen kernel raises (a torch without it, an argument it refuses),
the per-segment path takes over for the rest of the process, with a warning.
`VLM_CATALOG_VARLEN_ATTENTION` (``auto`` | ``flash`` | ``triton`` | ``sdpa``)
forces one backend; `VLM_CATALOG_KERNELS` still wins: ``reference`` forces
SDPA, ``triton`` forces the kernel. `VLM_CATALOG_SDPA_BACKEND=cudnn` asks the
per-segment SDPA calls for cuDNN's fused attention first (`kernels.sdpa_backend`).

Pass the segment lengths on the host (`seqlens`) when you have them: the
per-segment choice otherwise reads `cu_seqlens` back from the device (a sync).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention_common import LOG2_E, dot_precision, forced_attention_backend
from kernels.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dtype,
    check_same_device,
    check_shape,
    check_unit_stride_last_dim,
)
from kernels.dispatch import kernel_backend, use_triton
from kernels.flash_varlen import (
    flash_takes_long_sequences,
    flash_varlen_usable,
    try_flash_varlen_attention,
)
from kernels.launch_math import cdiv, next_power_of_2
from kernels.pdl import launch_options
from kernels.sdpa_backend import long_segment_sdpa
from kernels.strides import common_power_of_two

VARLEN_BACKEND_ENV_VAR = "VLM_CATALOG_VARLEN_ATTENTION"
VARLEN_BACKENDS = ("flash", "triton", "sdpa")
SDPA_MIN_SEGMENT_LEN = 2048  # from the H100 crossover, see the module docstring


# --------------------------------------------------------------------------- reference
def varlen_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Per-segment SDPA in torch's own backend order, as transformers' vision attention does
    without flash-attn."""
    out = torch.empty_like(q)
    bounds = [(begin, end) for begin, end in itertools.pairwise(cu_seqlens.tolist()) if end > begin]
    _sdpa_segments(q, k, v, bounds, scale, out, backend="default")
    return out


# --------------------------------------------------------------------------- triton
@dataclass(frozen=True)
class VarlenTiles:
    """A launch of the Triton kernel: BLOCK_M query rows and BLOCK_N keys per step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def varlen_tiles(max_seqlen: int, head_dim: int, element_size: int) -> VarlenTiles:
    """The kernel's tiles for segments of up to `max_seqlen` rows (as measured on the H100 of
    2026-11-25 at 64 rows, 64 keys and 4 warps)."""
    block_m = 64 if max_seqlen > 32 else 16
    # float32 tiles take twice the registers: at 64 x 64 and 4 warps ptxas spills ~30 KB
    # (tests/kernels/sm90_compile.py --float32); 64 x 32 on 8 warps spills nothing.
    wide_elements = element_size > 2
    block_n = 32 if head_dim > 128 or wide_elements else 64
    return VarlenTiles(block_m, block_n, num_warps=8 if wide_elements else 4, num_stages=2)


def varlen_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    max_seqlen: int | None = None,
    max_segment_len: int | None = None,
) -> torch.Tensor:
    """`max_seqlen`: optional host-side longest segment (otherwise computed: a device sync).
    `max_segment_len`: segments longer than this are not computed (their rows of the
    output are left unwritten, for another backend); None computes all."""

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
    tiles = varlen_tiles(max_seqlen, head_dim, q.element_size())
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               out.stride(0), out.stride(1))
    grid = (cdiv(max(max_seqlen, 1), tiles.block_m), num_segments, num_heads)
    varlen_attention_kernel[grid](
        # pointers
        q,
        k,
        v,
        cu_seqlens,
        out,
        # sizes
        scale * LOG2_E,
        max_segment_len if max_segment_len is not None else num_tokens,
        # strides
        *strides,
        # meta-parameters
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        STRIDE_MULTIPLE=common_power_of_two(strides),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **launch_options(q),
    )
    return out


# --------------------------------------------------------------------------- dispatch
def varlen_backend(segment_len: int) -> str:
    """ "triton" or "sdpa" for one segment of a CUDA call without the varlen kernel."""
    forced = forced_attention_backend(VARLEN_BACKEND_ENV_VAR, VARLEN_BACKENDS)
    if forced in ("triton", "sdpa"):
        return forced
    return "sdpa" if segment_len >= SDPA_MIN_SEGMENT_LEN else "triton"


def _sdpa_segments(q, k, v, bounds: list[tuple[int, int]], scale: float, out: torch.Tensor,
                   backend: str | None = None) -> None:
    """Per-segment SDPA into the rows `bounds` of `out`, in `long_segment_sdpa(backend)`'s context
    (None: `VLM_CATALOG_SDPA_BACKEND`)."""
    with long_segment_sdpa(backend):
        for begin, end in bounds:
            context = F.scaled_dot_product_attention(
                q[begin:end].transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
                k[begin:end].transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
                v[begin:end].transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
                scale=scale,
            )  # [1, H, n, D]
            out[begin:end] = context[0].transpose(0, 1)  # [n, H, D]


def varlen_attention_per_segment(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    seqlens: list[int],
) -> torch.Tensor:
    """Each segment through the backend `varlen_backend` picks for its length: the short
    ones in one Triton launch (which skips the long ones), the long ones through SDPA."""
    starts = list(itertools.accumulate([0] + seqlens[:-1]))
    long_segments = [(s, s + n) for s, n in zip(starts, seqlens) if n and varlen_backend(n) == "sdpa"]
    short_lengths = [n for n in seqlens if n and varlen_backend(n) == "triton"]
    if not long_segments:
        return varlen_attention_triton(q, k, v, cu_seqlens, scale, max_seqlen=max(short_lengths, default=0))
    if short_lengths:
        longest_short = max(short_lengths)
        out = varlen_attention_triton(
            q, k, v, cu_seqlens, scale, max_seqlen=longest_short, max_segment_len=longest_short
        )
    else:
        out = torch.empty_like(q)
    _sdpa_segments(q, k, v, long_segments, scale, out)
    return out


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    max_seqlen: int | None = None,
    seqlens: list[int] | None = None,
) -> torch.Tensor:
    """q, k, v [N, H, D], cu_seqlens [n+1] -> [N, H, D]; non-causal within each segment.
    `seqlens`: the n segment lengths on the host, if known (saves a device sync)."""
    if not use_triton(q, k, v, cu_seqlens, op="varlen_attention"):
        return varlen_attention_reference(q, k, v, cu_seqlens, scale)
    if kernel_backend() == "triton":
        return varlen_attention_triton(q, k, v, cu_seqlens, scale, max_seqlen=max_seqlen)
    return varlen_attention_on_device(q, k, v, cu_seqlens, scale, max_seqlen=max_seqlen, seqlens=seqlens)


def varlen_attention_on_device(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    max_seqlen: int | None = None,
    seqlens: list[int] | None = None,
) -> torch.Tensor:
    """The CUDA choice: the varlen kernel when it can take the call and no segment is long
    enough for SDPA (or the environment forces it, or the kernel is FlashAttention 3, which
    takes every length), else segment by segment."""
    forced = forced_attention_backend(VARLEN_BACKEND_ENV_VAR, VARLEN_BACKENDS)
    if forced in (None, "flash") and flash_varlen_usable(q, "bidirectional"):
        if max_seqlen is None:
            max_seqlen = max(seqlens) if seqlens is not None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        if forced == "flash" or max_seqlen < SDPA_MIN_SEGMENT_LEN or flash_takes_long_sequences():
            out = try_flash_varlen_attention("bidirectional", q, k, v, cu_seqlens, scale, max_seqlen)
            if out is not None:
                return out
    if seqlens is None:
        seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    return varlen_attention_per_segment(q, k, v, cu_seqlens, scale, seqlens)
