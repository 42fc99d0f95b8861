"""A dense linear layer with block-FP8 weights: out = x @ W^T + bias.

W [N, K] is float8 e4m3 with one float32 scale per `block = (block_n, block_k)`
block (kernels/fp8.py). With `fp8_activations` ("W8A8", as vLLM and SGLang run
Qwen's -FP8 checkpoints) x is quantized per row and block_k columns first, so
both GEMM operands are FP8: twice the bf16 tensor-core rate on Hopper, for the
decoder's attention projections (about a third of its prefill FLOPs at
30B-A3B; the MoE experts are the rest, kernels/moe/fused_moe.py). Without it
("W8A16") each weight tile is widened to x's dtype and only memory is saved.

Reference: W widened to float32, x as the quantization sees it (`gemm_input`),
one float32 GEMM, the bias added in float32 and the result rounded once to x's
dtype. The Triton kernel (kernels/jit/fp8_linear.py) accumulates each K step in
fp32 and rounds once too, so it matches within TOLERANCE[dtype] at any size.

Per-channel weights are blocks of one row spanning K (`kernels.fp8.per_channel_block`,
scales [N, 1]); with `fp8_activations` each row of x then has one scale. The kernel
applies such scales once after its K loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels import fp8_input, fp8_linear_cublas
from kernels.attention_common import dot_precision
from kernels.checks import (
    FLOAT_DTYPES,
    check_block_scales,
    check_dtype,
    check_same_device,
    check_shape,
    check_unit_stride_last_dim,
)
from kernels.dispatch import use_triton, widens_with_ptx
from kernels.fp8 import (
    FP8_DTYPE,
    dequantize,
    fp8_k_loop,
    gemm_input,
    imprecise_accumulation,
    quantize_activations,
)
from kernels.fp8_input import Fp8Input, Fp8InputLayout
from kernels.launch_math import cdiv
from kernels.moe.configs import MoeKernelConfig, as_moe_config
from kernels.pdl import launch_options


def fp8_linear(
    x: torch.Tensor | Fp8Input,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    fp8_activations: bool = False,
) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype, for W [N, K] e4m3 and its block scales. W8A8 on a
    Hopper GPU runs on cuBLAS where it passed its check (kernels/fp8_linear_cublas.py). x may
    come quantized already (`Fp8Input` [M, K], in `fp8_linear_input_layout`): then [M, N]."""
    if isinstance(x, Fp8Input):
        return _fp8_linear_quantized(x, weight, weight_scale, block, bias)
    if use_triton(x, weight, op="fp8_linear"):
        if fp8_activations and fp8_linear_cublas.usable(x, weight, weight_scale, block):
            return fp8_linear_cublas.fp8_linear_cublas(x, weight, weight_scale, bias, block=block)
        return fp8_linear_triton(x, weight, weight_scale, block, bias, fp8_activations)
    return fp8_linear_reference(x, weight, weight_scale, block, bias, fp8_activations)


def fp8_linear_input_layout(
    like: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int]
) -> Fp8InputLayout | None:
    """How the W8A8 GEMM of an input like `like` (its dtype and device) takes that input quantized
    by the kernel before it (kernels/fp8_input.py): where it runs on cuBLAS, cuBLAS's layout;
    elsewhere None (it quantizes its 16-bit input itself)."""
    if not (fp8_input.wanted() and use_triton(like, weight, op="fp8_linear")
            and fp8_linear_cublas.usable(like, weight, weight_scale, block)):
        return None
    return fp8_linear_cublas.input_layout(block, weight.shape[1])


def _fp8_linear_quantized(
    x: Fp8Input, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """W8A8 of rows quantized ahead: cuBLAS where it is usable, as `fp8_linear_input_layout` promised;
    anywhere else (it was turned off since) the reference's arithmetic on the same FP8 values."""
    like = torch.empty((0, x.shape[1]), dtype=x.dtype, device=x.device)  # x's 16-bit rows, for the checks
    _check_args(like, weight, weight_scale, block, bias)
    if use_triton(like, weight, op="fp8_linear") and fp8_linear_cublas.usable(like, weight, weight_scale, block):
        return fp8_linear_cublas.fp8_linear_cublas(x, weight, weight_scale, bias, block=block)
    widened = dequantize(weight, weight_scale, tuple(block), torch.float32)  # [N, K]
    return F.linear(x.dequantized(), widened, None if bias is None else bias.float()).to(x.dtype)  # [M, N]


def fp8_linear_rows(
    rows: Sequence[torch.Tensor],
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    fp8_activations: bool = False,
) -> torch.Tensor:
    """`fp8_linear` of consecutive row pieces [M_i, K] of one input (a step's decode and prefill
    attention outputs, from different kernels): [sum M_i, N]. Where cuBLAS's W8A8 GEMM runs, each
    piece is quantized into its rows of the GEMM's FP8 input, so the 16-bit pieces are never
    stacked (at a 16k-token step, 134 MB copied per layer); elsewhere they are stacked first."""
    if not rows:
        raise ValueError("rows: expected at least one piece")
    first = rows[0]
    if (len(rows) > 1 and fp8_activations and use_triton(first, weight, op="fp8_linear")
            and fp8_linear_cublas.usable(first, weight, weight_scale, block)):
        return fp8_linear_cublas.fp8_linear_cublas(rows, weight, weight_scale, bias, block=block)
    return fp8_linear(rows[0] if len(rows) == 1 else torch.cat(list(rows)), weight, weight_scale, block, bias,
                      fp8_activations)


def fp8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    fp8_activations: bool = False,
) -> torch.Tensor:
    _check_args(x, weight, weight_scale, block, bias)
    flat = x.reshape(-1, x.shape[-1])  # [M, K]
    widened = dequantize(weight, weight_scale, tuple(block), torch.float32)  # [N, K]
    out = F.linear(gemm_input(flat, block[1], fp8_activations), widened, None if bias is None else bias.float())
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])  # [..., N]


def dense_fp8_config(num_rows: int) -> MoeKernelConfig:
    """Tiles for M rows (untuned, reasoned like the MoE table: up to 64 rows the GEMM streams the
    weight once and is bandwidth bound, so narrow M and long K steps; above, square 128 tiles
    that fit three pipeline stages of a bf16 x tile and an FP8 weight tile in shared memory)."""
    if num_rows <= 16:
        return MoeKernelConfig(16, 64, 128, 1, num_warps=4, num_stages=4)
    if num_rows <= 64:
        return MoeKernelConfig(32, 64, 128, 1, num_warps=4, num_stages=4)
    if num_rows <= 256:
        return MoeKernelConfig(64, 128, 128, 8, num_warps=4, num_stages=3)
    return MoeKernelConfig(128, 128, 128, 8, num_warps=8, num_stages=3)


def fp8_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    fp8_activations: bool = False,
    config: MoeKernelConfig | None = None,
) -> torch.Tensor:
    from kernels.jit.fp8_linear import fp8_linear_kernel

    _check_args(x, weight, weight_scale, block, bias)
    check_same_device(x=x, weight=weight, weight_scale=weight_scale)
    quant_n, quant_k = block
    out_features, in_features = weight.shape
    flat = x.reshape(-1, in_features)  # [M, K]
    if flat.shape[0] > 0 and flat.stride(-1) != 1:
        flat = flat.contiguous()
    num_rows = flat.shape[0]
    out = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)  # [M, N]
    if num_rows == 0:
        return out.view(*x.shape[:-1], out_features)
    config = as_moe_config(config or dense_fp8_config(num_rows))
    inputs, input_scale = flat, flat  # the scale is a placeholder unless FP8_ACTIVATIONS
    if fp8_activations:
        inputs, input_scale = quantize_activations(flat, quant_k)  # [M, K] e4m3, [M, K / quant_k]
    block_k, scale_after_loop = fp8_k_loop(config.block_size_k, quant_k, in_features)
    grid = (cdiv(num_rows, config.block_size_m) * cdiv(out_features, config.block_size_n),)
    fp8_linear_kernel[grid](
        # pointers
        inputs,
        input_scale,
        weight,
        weight_scale,
        flat if bias is None else bias,
        out,
        # sizes
        num_rows,
        out_features,
        in_features,
        # strides
        inputs.stride(0),
        input_scale.stride(0),
        weight.stride(0),
        weight_scale.stride(0),
        out.stride(0),
        # meta-parameters
        BLOCK_M=config.block_size_m,
        BLOCK_N=config.block_size_n,
        BLOCK_K=block_k,
        GROUP_M=config.group_size_m,
        DOT_PRECISION=dot_precision(x.dtype),
        FP8_ACTIVATIONS=fp8_activations,
        HAS_BIAS=bias is not None,
        QUANT_N=quant_n,
        QUANT_K=quant_k,
        WIDEN_WITH_PTX=widens_with_ptx(fp8_linear_kernel),
        SCALE_AFTER_LOOP=scale_after_loop,
        IMPRECISE_ACC_K=imprecise_accumulation(block_k),
        **config.launch_options(),
        **launch_options(inputs),
    )
    return out.view(*x.shape[:-1], out_features)  # [..., N]


def _check_args(x, weight, weight_scale, block, bias) -> None:
    check_shape("weight", weight, (None, None))
    out_features, in_features = weight.shape
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"x: the last dimension must be the weight's in_features {in_features}, got {tuple(x.shape)}")
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, (FP8_DTYPE,))
    check_block_scales("weight_scale", weight_scale, (out_features, in_features), block)
    check_unit_stride_last_dim("weight", weight)
    if bias is not None:
        check_shape("bias", bias, (out_features,))
        check_dtype("bias", bias, FLOAT_DTYPES)
        check_unit_stride_last_dim("bias", bias)
