"""RMSNorm, alone, fused with the residual add, and fused with the sum of the fused MoE's
expert terms before that add (`fused_sum_add_rms_norm`: one launch where a sum and the
add-and-norm took two), or with the sum of weighted rows gathered from the grouped-GEMM MoE's
expert-sorted output (`gathered_sum_add_rms_norm`: the gather, the weights and the sum in
the norm's one pass, instead of writing and reading the terms). Each can also write its output
as the next W8A8 GEMM's FP8 input (`quantize=`, kernels/fp8_input.py): the 16-bit row rounded
as always, then quantized in the same program, where a separate launch used to read it back.

Arithmetic order follows transformers' `Qwen3VLMoeTextRMSNorm` exactly::

    h = x.float()
    h = h * rsqrt(mean(h ** 2) + eps)
    out = weight * h.to(x.dtype)        # cast back BEFORE the weight multiply

so the output dtype is `torch.promote_types(weight.dtype, x.dtype)`, as in torch.
"""

from __future__ import annotations

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
from kernels.fp8 import kernels_take_group
from kernels.fp8_input import Fp8Input, Fp8InputLayout, empty_fp8_input, quantize_fp8_input
from kernels.launch_math import next_power_of_2, triton_dtype
from kernels.pdl import launch_options


# --------------------------------------------------------------------------- reference
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> [..., H]."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the sum is kept in x.dtype."""
    new_residual = (x + residual).to(x.dtype)
    return rms_norm_reference(new_residual, weight, eps), new_residual


def fused_sum_add_rms_norm_reference(
    terms: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_add_rms_norm_reference` of the sum of terms [T, K, H] over K, which accumulates
    in float32 and rounds once to terms.dtype (torch's sum of 16-bit values does)."""
    return fused_add_rms_norm_reference(terms.sum(1), residual, weight, eps)


def gathered_terms_reference(values: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """values [R, H], rows / weights [T, K] -> terms [T, K, H], terms[t, k] = values[rows[t, k]] *
    weights[t, k] in values' dtype (one rounding per product, as a 16-bit multiply)."""
    num_tokens, num_terms = rows.shape
    products = values.index_select(0, rows.reshape(-1).long()) * weights.reshape(-1, 1).to(values.dtype)  # [T*K, H]
    return products.view(num_tokens, num_terms, values.shape[1])  # [T*K, H] -> [T, K, H]


def gathered_sum_add_rms_norm_reference(
    values: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_sum_add_rms_norm_reference` of the terms `gathered_terms_reference` makes."""
    return fused_sum_add_rms_norm_reference(gathered_terms_reference(values, rows, weights), residual, weight, eps)


# --------------------------------------------------------------------------- triton
def _check_rms_norm_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() < 1:
        raise ValueError("x: expected at least 1 dimension [..., H]")
    check_shape("weight", weight, (x.shape[-1],))
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, FLOAT_DTYPES)
    check_same_device(x=x, weight=weight)
    check_unit_stride_last_dim("weight", weight)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, num_terms: int = 1,
    gather: tuple[torch.Tensor, torch.Tensor] | None = None, quantize: Fp8InputLayout | None = None,
) -> tuple[torch.Tensor | Fp8Input, torch.Tensor | None]:
    """x [..., H], or [T, num_terms, H] when num_terms > 1 (summed over the terms first), or with
    `gather` = (rows, weights) [T, num_terms] the values [R, H] those rows pick. With `quantize`
    the output comes as the next GEMM's FP8 input (`Fp8Input` [T, H]), in the same launch where
    the layout's group is one per row or a power of two."""

    from kernels.jit.rms_norm import rms_norm_kernel

    hidden_size = x.shape[-1]
    if gather is not None:
        term_rows, term_weights = gather
        rows, out_shape = x, (term_rows.shape[0], hidden_size)  # values [R, H] -> [T, H]
        term_stride = 0
    elif num_terms > 1:
        rows, out_shape = x, (x.shape[0], hidden_size)  # [T, K, H] -> [T, H]
        term_stride = x.stride(1)
    else:
        rows, out_shape = x.reshape(-1, hidden_size), x.shape  # [T, H]
        term_stride = 0
    check_unit_stride_last_dim("x", rows)
    num_rows = out_shape[0] if gather is not None else rows.shape[0]
    block_size = next_power_of_2(hidden_size)
    group = _kernel_group(quantize, hidden_size, block_size)
    if quantize is not None and group is None:  # a group the kernel cannot hold: the norm, then the quantizer
        out, new_residual = _launch(x, residual, weight, eps, num_terms, gather)
        return quantize_fp8_input(out.reshape(-1, hidden_size), quantize), new_residual  # [T, H]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    write_out = quantize is None or quantize.keep_unquantized
    out = torch.empty((num_rows if write_out else 0, hidden_size), dtype=out_dtype, device=x.device)
    if residual is not None:
        residual_rows = residual.reshape(-1, hidden_size)  # [T, H]
        check_unit_stride_last_dim("residual", residual_rows)
        new_residual = torch.empty((num_rows, hidden_size), dtype=x.dtype, device=x.device)
    else:  # the kernel never touches these when ADD_RESIDUAL is False
        residual_rows = new_residual = out
    if gather is None:  # placeholders, never read when GATHER_TERMS is False
        term_rows = term_weights = out
    if quantize is not None:  # [T_pad, H] e4m3, [T_pad, G]: padding programs write their zero rows
        quantized, scale = empty_fp8_input(num_rows, hidden_size, quantize, x.device)
        grid_rows = quantized.shape[0] if num_rows else 0
    else:  # placeholders, never written when QUANTIZE is False
        quantized = scale = out
        grid_rows = num_rows
    if grid_rows > 0:
        rms_norm_kernel[(grid_rows,)](
            # pointers
            rows,
            residual_rows,
            weight,
            out,
            new_residual,
            term_rows,
            term_weights,
            quantized,
            scale,
            # sizes
            num_rows,
            hidden_size,
            eps,
            # strides
            rows.stride(0),
            term_stride,
            residual_rows.stride(0),
            out.stride(0),
            new_residual.stride(0),
            quantized.stride(0),
            scale.stride(0),
            scale.stride(1),
            # meta-parameters
            BLOCK_SIZE=block_size,
            ADD_RESIDUAL=residual is not None,
            NUM_TERMS=num_terms,
            GATHER_TERMS=gather is not None,
            OUT_DTYPE=triton_dtype(out_dtype),
            WRITE_OUT=write_out,
            QUANTIZE=quantize is not None,
            GROUP=group or block_size,
            num_warps=min(max(block_size // 256, 1), 16),
            **launch_options(rows),
        )
    if residual is not None:
        new_residual = new_residual.view(out_shape)  # [..., H]
    if quantize is not None:
        return Fp8Input(quantized, scale, num_rows, quantize.group, out_dtype, out if write_out else None), \
            new_residual if residual is not None else None
    out = out.view(out_shape)  # [..., H]
    if residual is None:
        return out, None
    return out, new_residual


def _kernel_group(quantize: Fp8InputLayout | None, hidden_size: int, block_size: int) -> int | None:
    """The kernel's GROUP for the layout: the whole (power-of-two) row for one scale per row, the
    layout's group where it is a power of two, else None (and None without a layout)."""
    if quantize is None or not kernels_take_group(quantize.group, hidden_size):
        return None
    return block_size if quantize.group >= hidden_size else quantize.group


def _quantized_reference(
    normed: torch.Tensor, new_residual: torch.Tensor | None, quantize: Fp8InputLayout | None
) -> tuple[torch.Tensor | Fp8Input, torch.Tensor | None]:
    """A reference's (normed, new residual), the normed rows as the next GEMM's FP8 input where asked."""
    if quantize is None:
        return normed, new_residual
    return quantize_fp8_input(normed.reshape(-1, normed.shape[-1]), quantize), new_residual  # [T, H]


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, quantize: Fp8InputLayout | None = None
) -> torch.Tensor | Fp8Input:
    _check_rms_norm_args(x, weight)
    out, _ = _launch(x, None, weight, eps, quantize=quantize)
    return out


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, quantize: Fp8InputLayout | None = None
) -> tuple[torch.Tensor | Fp8Input, torch.Tensor]:
    _check_rms_norm_args(x, weight)
    check_shape("residual", residual, tuple(x.shape))
    check_dtype("residual", residual, FLOAT_DTYPES)
    check_same_device(x=x, residual=residual)
    out, new_residual = _launch(x, residual, weight, eps, quantize=quantize)
    assert new_residual is not None
    return out, new_residual


def fused_sum_add_rms_norm_triton(
    terms: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    quantize: Fp8InputLayout | None = None,
) -> tuple[torch.Tensor | Fp8Input, torch.Tensor]:
    _check_rms_norm_args(terms, weight)
    check_shape("terms", terms, (None, None, weight.shape[0]))
    check_shape("residual", residual, (terms.shape[0], terms.shape[2]))
    check_dtype("residual", residual, FLOAT_DTYPES)
    check_same_device(terms=terms, residual=residual)
    if terms.shape[1] == 0:
        raise ValueError("terms: expected at least one term, got shape [T, 0, H]")
    if terms.shape[1] == 1:  # [T, 1, H] -> [T, H]: the add-and-norm alone
        return fused_add_rms_norm_triton(terms[:, 0], residual, weight, eps, quantize)
    out, new_residual = _launch(terms, residual, weight, eps, num_terms=terms.shape[1], quantize=quantize)
    assert new_residual is not None
    return out, new_residual


def gathered_sum_add_rms_norm_triton(
    values: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
    eps: float, quantize: Fp8InputLayout | None = None,
) -> tuple[torch.Tensor | Fp8Input, torch.Tensor]:
    _check_rms_norm_args(values, weight)
    check_shape("values", values, (None, weight.shape[0]))
    check_shape("weights", weights, tuple(rows.shape))
    check_shape("residual", residual, (rows.shape[0], values.shape[1]))
    check_dtype("rows", rows, INDEX_DTYPES)
    check_dtype("weights", weights, FLOAT_DTYPES)
    check_dtype("residual", residual, FLOAT_DTYPES)
    check_same_device(values=values, rows=rows, weights=weights, residual=residual)
    if rows.dim() != 2 or rows.shape[1] == 0:
        raise ValueError(f"rows: expected [T, K] with K >= 1, got shape {list(rows.shape)}")
    out, new_residual = _launch(values, residual, weight, eps, num_terms=rows.shape[1],
                                gather=(rows.contiguous(), weights.contiguous()), quantize=quantize)
    assert new_residual is not None
    return out, new_residual


# --------------------------------------------------------------------------- dispatch
# `quantize`: the next W8A8 GEMM's FP8 input layout (kernels/fp8_input.py). Given, the normed rows
# come as that input (`Fp8Input` [T, H], in the norm's own launch on the Triton path), where
# they would come in 16 bits.
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, quantize: Fp8InputLayout | None = None
) -> torch.Tensor | Fp8Input:
    """x [T, H] (any leading dims), weight [H] -> [T, H]."""
    if use_triton(x, weight, op="rms_norm"):
        return rms_norm_triton(x, weight, eps, quantize)
    return _quantized_reference(rms_norm_reference(x, weight, eps), None, quantize)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    quantize: Fp8InputLayout | None = None,
) -> tuple[torch.Tensor | Fp8Input, torch.Tensor]:
    """(x [T, H], residual [T, H]) -> (normed [T, H], new_residual = x + residual [T, H])."""
    if use_triton(x, residual, weight, op="fused_add_rms_norm"):
        return fused_add_rms_norm_triton(x, residual, weight, eps, quantize)
    return _quantized_reference(*fused_add_rms_norm_reference(x, residual, weight, eps), quantize)


def fused_sum_add_rms_norm(
    terms: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    quantize: Fp8InputLayout | None = None,
) -> tuple[torch.Tensor | Fp8Input, torch.Tensor]:
    """(terms [T, K, H], residual [T, H]) -> (normed [T, H], new_residual = sum_k terms + residual [T, H])."""
    if use_triton(terms, residual, weight, op="fused_sum_add_rms_norm"):
        return fused_sum_add_rms_norm_triton(terms, residual, weight, eps, quantize)
    return _quantized_reference(*fused_sum_add_rms_norm_reference(terms, residual, weight, eps), quantize)


def gathered_sum_add_rms_norm(
    values: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
    eps: float, quantize: Fp8InputLayout | None = None,
) -> tuple[torch.Tensor | Fp8Input, torch.Tensor]:
    """(values [R, H], rows / weights [T, K], residual [T, H]) -> (normed [T, H], new_residual =
    sum_k values[rows[t, k]] * weights[t, k] + residual [T, H]); each product rounded to values'
    dtype, the sum in float32 rounded once (`gathered_sum_add_rms_norm_reference`)."""
    if use_triton(values, rows, weights, residual, weight, op="fused_sum_add_rms_norm"):
        return gathered_sum_add_rms_norm_triton(values, rows, weights, residual, weight, eps, quantize)
    return _quantized_reference(
        *gathered_sum_add_rms_norm_reference(values, rows, weights, residual, weight, eps), quantize)
