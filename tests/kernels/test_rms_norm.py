"""rms_norm / fused_add_rms_norm: reference vs transformers and float64, Triton vs reference."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.rms_norm import (
    fused_add_rms_norm_reference,
    fused_add_rms_norm_triton,
    fused_sum_add_rms_norm_reference,
    fused_sum_add_rms_norm_triton,
    gathered_sum_add_rms_norm_reference,
    gathered_sum_add_rms_norm_triton,
    gathered_terms_reference,
    rms_norm_reference,
    rms_norm_triton,
)
from tests.kernels.helpers import TOLERANCE, assert_close

EPS = 1e-6


def float64_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return weight.double() * x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps)


def test_reference_matches_transformers_bitwise():
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextRMSNorm

    for dtype in (torch.float32, torch.bfloat16):
        norm = Qwen3VLMoeTextRMSNorm(48, eps=EPS).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(48))
        x = torch.randn(9, 48, dtype=dtype) * 3
        with torch.no_grad():
            expected = norm(x)
        torch.testing.assert_close(
            rms_norm_reference(x, norm.weight.detach(), EPS), expected, rtol=0, atol=0
        )


def test_reference_against_float64():
    # tolerance: float32 1e-6 relative (a handful of float32 roundings)
    x, weight = torch.randn(7, 40) * 5, torch.randn(40)
    assert_close(rms_norm_reference(x, weight, EPS), float64_rms_norm(x, weight, EPS), rel=1e-6)


def test_fused_add_reference_is_add_then_norm():
    x, residual, weight = (
        torch.randn(4, 16, dtype=torch.bfloat16),
        torch.randn(4, 16, dtype=torch.bfloat16),
        torch.randn(16, dtype=torch.bfloat16),
    )
    normed, new_residual = fused_add_rms_norm_reference(x, residual, weight, EPS)
    assert new_residual.dtype == torch.bfloat16
    torch.testing.assert_close(new_residual, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(
        normed, rms_norm_reference(x + residual, weight, EPS), rtol=0, atol=0
    )


def test_cpu_dispatch_uses_reference():
    x, weight = torch.randn(3, 8), torch.randn(8)
    torch.testing.assert_close(
        kernels.rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS), rtol=0, atol=0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens,hidden", [(1, 8), (7, 40), (3, 2048)])
def test_triton_rms_norm(triton_device, poison_allocations, dtype, num_tokens, hidden):
    # tolerance: TOLERANCE[dtype] (float32 1e-4, 16-bit 1e-2), max-norm relative
    x = (torch.randn(num_tokens, hidden) * 4).to(dtype).to(triton_device)
    weight = torch.randn(hidden).to(dtype).to(triton_device)
    out = kernels.rms_norm(x, weight, EPS)  # dispatches to Triton (VLM_CATALOG_KERNELS=triton)
    assert out.dtype == dtype
    assert_close(out, rms_norm_reference(x, weight, EPS), rel=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,hidden", [(1, 8), (5, 72)])
def test_triton_fused_add_rms_norm(triton_device, poison_allocations, dtype, num_tokens, hidden):
    # tolerance: TOLERANCE[dtype] for the norm; the new residual is one rounding of x + residual
    x = torch.randn(num_tokens, hidden).to(dtype).to(triton_device)
    residual = torch.randn(num_tokens, hidden).to(dtype).to(triton_device)
    weight = torch.randn(hidden).to(dtype).to(triton_device)
    normed, new_residual = fused_add_rms_norm_triton(x, residual, weight, EPS)
    expected_normed, expected_residual = fused_add_rms_norm_reference(x, residual, weight, EPS)
    assert_close(new_residual, expected_residual, rel=TOLERANCE[dtype], what="new_residual")
    assert_close(normed, expected_normed, rel=TOLERANCE[dtype], what="normed")


@pytest.mark.parametrize("function", [fused_sum_add_rms_norm_reference, fused_sum_add_rms_norm_triton])
def test_fused_sum_rounds_once_after_the_terms_then_after_the_residual(triton_device, function):
    # bfloat16, exactly: 1 + 7 * 2**-8 rounds to 1.03125 summed in float32 (1.0 rounded after
    # every add); 1 + 2**-8 rounds to 1.0 (a tie, to even) before 2**-8 of residual is added, which
    # rounds to 1.0 again (1.0078125 if the sum were not rounded first, as torch's sum is)
    bf16 = torch.bfloat16
    cases = [([1.0] + [2.0**-8] * 7, 0.0, 1.03125), ([1.0, 2.0**-8], 2.0**-8, 1.0)]
    for values, residual_value, expected in cases:
        terms = torch.tensor(values, dtype=bf16).view(1, -1, 1).expand(2, -1, 4).contiguous().to(triton_device)
        residual = torch.full((2, 4), residual_value, dtype=bf16, device=triton_device)
        _, new_residual = function(terms, residual, torch.ones(4, device=triton_device), EPS)
        assert torch.equal(new_residual.cpu(), torch.full((2, 4), expected, dtype=bf16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens,num_terms,hidden", [(1, 8, 8), (5, 3, 72), (4, 1, 40), (3, 8, 2048)])
def test_triton_fused_sum_add_rms_norm(triton_device, poison_allocations, dtype, num_tokens, num_terms, hidden):
    # tolerance: the new residual within one rounding of the reference's (the float32 sums may
    # differ in order), i.e. 2**-7 relative in bfloat16; the norm at TOLERANCE[dtype]
    terms = torch.randn(num_tokens, num_terms, hidden).to(dtype).to(triton_device)
    residual = torch.randn(num_tokens, hidden).to(dtype).to(triton_device)
    weight = torch.randn(hidden).to(dtype).to(triton_device)
    normed, new_residual = kernels.fused_sum_add_rms_norm(terms, residual, weight, EPS)
    expected_normed, expected_residual = fused_sum_add_rms_norm_reference(terms, residual, weight, EPS)
    assert normed.shape == new_residual.shape == (num_tokens, hidden) and new_residual.dtype == dtype
    unit = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
    torch.testing.assert_close(new_residual, expected_residual, rtol=unit, atol=unit)
    assert_close(normed, expected_normed, rel=TOLERANCE[dtype], what="normed")


def test_triton_fused_sum_takes_strided_terms_and_rejects_bad_ones(triton_device):
    # the fused MoE's terms are a view of its [T*K, H] buffer; a column slice keeps unit stride
    terms = torch.randn(3, 4, 64, device=triton_device)[:, :, :40]
    residual, weight = torch.randn(3, 40, device=triton_device), torch.randn(40, device=triton_device)
    for actual, expected in zip(fused_sum_add_rms_norm_triton(terms, residual, weight, EPS),
                                fused_sum_add_rms_norm_reference(terms, residual, weight, EPS)):
        assert_close(actual, expected, rel=1e-4)
    with pytest.raises(ValueError, match="at least one term"):
        fused_sum_add_rms_norm_triton(terms[:, :0], residual, weight, EPS)
    with pytest.raises(ValueError, match="residual"):
        fused_sum_add_rms_norm_triton(terms, residual[:2], weight, EPS)
    with pytest.raises(ValueError, match="terms"):
        fused_sum_add_rms_norm_triton(terms[0], residual, weight, EPS)


def gathered_inputs(num_tokens, num_terms, hidden, dtype, device):
    """values [R, H] in expert order (R = T*K), each token's K rows of them (a permutation, as the
    grouped-GEMM MoE's rows are), and routing weights [T, K] in float32."""
    values = torch.randn(num_tokens * num_terms, hidden).to(dtype)
    rows = torch.randperm(num_tokens * num_terms).view(num_tokens, num_terms)
    weights = torch.rand(num_tokens, num_terms).softmax(-1)
    residual = torch.randn(num_tokens, hidden).to(dtype)
    return [t.to(device) for t in (values, rows, weights, residual)]


def test_gathered_terms_weigh_the_rows_each_token_names():
    values, rows, weights, _ = gathered_inputs(3, 2, 8, torch.bfloat16, "cpu")
    terms = gathered_terms_reference(values, rows, weights)
    for t in range(3):
        for k in range(2):  # one bf16 rounding per product, as a 16-bit multiply
            expected = (values[rows[t, k]].float() * weights[t, k].to(torch.bfloat16).float()).to(torch.bfloat16)
            assert torch.equal(terms[t, k], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,num_terms,hidden", [(1, 8, 8), (5, 3, 72), (4, 1, 40), (3, 8, 2048)])
def test_triton_gathered_sum_add_rms_norm(triton_device, poison_allocations, dtype, num_tokens, num_terms, hidden):
    # tolerance: as test_triton_fused_sum_add_rms_norm (the float32 sums may differ in order)
    values, rows, weights, residual = gathered_inputs(num_tokens, num_terms, hidden, dtype, triton_device)
    weight = torch.randn(hidden).to(dtype).to(triton_device)
    normed, new_residual = kernels.gathered_sum_add_rms_norm(values, rows, weights, residual, weight, EPS)
    expected_normed, expected_residual = gathered_sum_add_rms_norm_reference(values, rows, weights, residual,
                                                                             weight, EPS)
    assert normed.shape == new_residual.shape == (num_tokens, hidden) and new_residual.dtype == dtype
    unit = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}[dtype]
    torch.testing.assert_close(new_residual, expected_residual, rtol=unit, atol=unit)
    assert_close(normed, expected_normed, rel=TOLERANCE[dtype], what="normed")


def test_triton_gathered_sum_rejects_bad_arguments(triton_device):
    values, rows, weights, residual = gathered_inputs(3, 2, 16, torch.float32, triton_device)
    weight = torch.randn(16, device=triton_device)
    with pytest.raises(ValueError, match="weights"):
        gathered_sum_add_rms_norm_triton(values, rows, weights[:, :1], residual, weight, EPS)
    with pytest.raises(ValueError, match="rows"):
        gathered_sum_add_rms_norm_triton(values, rows.float(), weights, residual, weight, EPS)
    with pytest.raises(ValueError, match="residual"):
        gathered_sum_add_rms_norm_triton(values, rows, weights, residual[:2], weight, EPS)
    with pytest.raises(ValueError, match="rows"):
        gathered_sum_add_rms_norm_triton(values, rows[:, :0], weights[:, :0], residual, weight, EPS)


def test_triton_mixed_dtypes_follow_torch_promotion(triton_device):
    # bf16 activations with a float32 weight give float32, as torch's `weight * h.to(x.dtype)`
    x = torch.randn(3, 24, dtype=torch.bfloat16, device=triton_device)
    weight = torch.randn(24, device=triton_device)
    out = rms_norm_triton(x, weight, EPS)
    assert out.dtype == torch.float32
    assert_close(out, rms_norm_reference(x, weight, EPS), rel=1e-4)


def test_triton_non_contiguous_rows(triton_device):
    x = torch.randn(6, 64, device=triton_device)[::2, :40]  # row stride 128, last dim contiguous
    weight = torch.randn(40, device=triton_device)
    assert_close(rms_norm_triton(x, weight, EPS), rms_norm_reference(x, weight, EPS), rel=1e-4)


def test_triton_wrapper_rejects_bad_arguments(triton_device):
    x = torch.randn(4, 16, device=triton_device)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, torch.randn(15, device=triton_device), EPS)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm_triton(x.to(torch.int32), torch.randn(16, device=triton_device), EPS)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm_triton(
            torch.randn(16, 4, device=triton_device).t(), torch.randn(16, device=triton_device), EPS
        )
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm_triton(
            x, torch.randn(4, 8, device=triton_device), torch.randn(16, device=triton_device), EPS
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_rms_norm_model_shapes(cuda_device, dtype):
    # tolerance: TOLERANCE[dtype]
    x = torch.randn(4096, 2048, device=cuda_device).to(dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(2048, device=cuda_device).to(dtype)
    assert_close(
        kernels.rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS), rel=TOLERANCE[dtype]
    )
    normed, new_residual = kernels.fused_add_rms_norm(x, residual, weight, EPS)
    expected_normed, expected_residual = fused_add_rms_norm_reference(x, residual, weight, EPS)
    assert_close(normed, expected_normed, rel=TOLERANCE[dtype])
    assert_close(new_residual, expected_residual, rel=TOLERANCE[dtype])
    terms = torch.randn(4096, 8, 2048, device=cuda_device).to(dtype)  # the 30B-A3B's 8 experts a token
    normed, new_residual = kernels.fused_sum_add_rms_norm(terms, residual, weight, EPS)
    expected_normed, expected_residual = fused_sum_add_rms_norm_reference(terms, residual, weight, EPS)
    assert_close(normed, expected_normed, rel=TOLERANCE[dtype])
    assert_close(new_residual, expected_residual, rel=TOLERANCE[dtype])
    values, rows, weights, _ = gathered_inputs(4096, 8, 2048, dtype, cuda_device)  # the grouped-GEMM MoE's
    normed, new_residual = kernels.gathered_sum_add_rms_norm(values, rows, weights, residual, weight, EPS)
    expected_normed, expected_residual = gathered_sum_add_rms_norm_reference(values, rows, weights, residual,
                                                                             weight, EPS)
    assert_close(normed, expected_normed, rel=TOLERANCE[dtype])
    assert_close(new_residual, expected_residual, rel=TOLERANCE[dtype])
