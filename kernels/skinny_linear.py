"""A dense projection of a few rows (`F.linear` with 16-bit weights), for decode steps at small
batches: a GEMV-like kernel that streams the weight once.

At batch 1 the decoder's q/k/v and o projections read 21.0 and 16.8 MB of bf16 weight per
layer. On the H100 of 2026-11-28 cuBLAS took 9.6 and 10.0 us for them in the decode graph
(75% and 58% of the copy bandwidth: 64x8 tiles for q/k/v, split-K and its reduce launch for
o). `skinny_linear` gives each of about N / 16 programs 16 output columns and all K, with
the rows padded to 16 for `tl.dot` (kernels/jit/skinny_linear.py): one launch, no reduce.
Up to `SKINNY_MAX_ROWS` rows and for float16 / bfloat16 only (float32 keeps `F.linear`,
whose full-precision sums `tl.dot` would round to TF32).

Its launch settings are a guess until `scripts/bench_kernels.py`'s rows
`skinny_linear[...]` have run on a GPU (`SKINNY_LAUNCH`): they time candidates against cuBLAS at the
30B-A3B projections, and `VLM_CATALOG_KERNELS_OFF=skinny_linear` turns it off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.checks import check_dtype, check_same_device, check_shape, check_unit_stride_last_dim
from kernels.dispatch import use_triton
from kernels.launch_math import cdiv
from kernels.pdl import launch_options, weight_prefetch_meta

SKINNY_MAX_ROWS = 8  # the largest batch given the kernel (a decode graph's first buckets: 1, 2, 4, 8)
SKINNY_DTYPES = (torch.float16, torch.bfloat16)


def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


# BLOCK_N, BLOCK_K, warps and stages, for every shape (a guess for H100-class GPUs until the kernel
# rows run): 16 columns a program (320 programs at q/k/v's 5120 columns, 128 at o's 2048) and
# 256-wide steps, four in flight (32 KiB of weight tiles per program)
SKINNY_LAUNCH = dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4)


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         launch: dict[str, int] | None = None, prefetch_weight: bool | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16) @ weight [N, K].T (+ bias [N]) -> [M, N] in x's dtype; `launch`: other
    BLOCK_N / BLOCK_K / num_warps / num_stages (the kernel rows' candidates); `prefetch_weight`:
    each program asks for its weight rows into L2 before it waits for the grid before it
    (None: where the launch uses PDL, `kernels.pdl.weight_prefetch_meta`)."""
    from kernels.jit.skinny_linear import skinny_linear_kernel

    check_shape("x", x, (None, None))
    check_shape("weight", weight, (None, x.shape[1]))
    check_dtype("x", x, SKINNY_DTYPES)
    check_dtype("weight", weight, (x.dtype,))
    check_unit_stride_last_dim("x", x)
    check_unit_stride_last_dim("weight", weight)
    if bias is not None:
        check_shape("bias", bias, (weight.shape[0],))
        check_dtype("bias", bias, (x.dtype,))
        check_unit_stride_last_dim("bias", bias)
    check_same_device(x=x, weight=weight, **({} if bias is None else {"bias": bias}))
    num_rows, reduction = x.shape
    num_cols = weight.shape[0]
    if num_rows > 16:
        raise ValueError(f"x: {num_rows} rows; the kernel pads rows to 16 (use F.linear past that)")
    out = torch.empty((num_rows, num_cols), dtype=x.dtype, device=x.device)
    if num_rows == 0 or num_cols == 0:
        return out
    settings = launch or SKINNY_LAUNCH
    options = launch_options(x)
    skinny_linear_kernel[(cdiv(num_cols, settings["BLOCK_N"]),)](
        # pointers
        x,
        weight,
        bias if bias is not None else x,  # a placeholder, never read without HAS_BIAS
        out,
        # sizes
        num_rows,
        num_cols,
        reduction,
        # strides
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        # meta-parameters
        BLOCK_M=16,
        BLOCK_N=settings["BLOCK_N"],
        BLOCK_K=settings["BLOCK_K"],
        HAS_BIAS=bias is not None,
        **weight_prefetch_meta(options, weight, settings["num_warps"], settings["BLOCK_N"], prefetch_weight),
        num_warps=settings["num_warps"],
        num_stages=settings["num_stages"],
        **options,
    )
    return out


def takes_skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `skinny_linear` would launch the kernel for these operands on the Triton path: the
    ones its checks take (`F.linear` takes the rest, strided rows included)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= SKINNY_MAX_ROWS and x.dtype in SKINNY_DTYPES
            and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.stride(-1) == 1
            and (bias is None or (bias.dtype == x.dtype and bias.stride(-1) == 1)))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: by the kernel on the Triton path for up to `SKINNY_MAX_ROWS`
    rows of 16-bit x, else `F.linear` itself."""
    if takes_skinny_linear(x, weight, bias) and use_triton(x, weight, op="skinny_linear"):
        return skinny_linear_triton(x, weight, bias)
    return F.linear(x, weight, bias)
