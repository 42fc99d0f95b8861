"""The RMSNorm writing the next W8A8 GEMM's FP8 input itself (kernels/fp8_input.py, `quantize=`).

Contract: the values and scales are the bits the activation quantizer gives for the 16-bit
rows the same norm writes without `quantize` (so the GEMM after it cannot tell), in the
layout the GEMM asked for: padding rows zero with scale 1, the scales' strides, the 16-bit
rows kept only where asked. Exact (rtol = atol = 0): one arithmetic, `quantize_rows`.
Every empty tensor is poisoned, so an element a kernel forgets shows up.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.fp8_input import Fp8Input, Fp8InputLayout, quantize_fp8_input
from tests.kernels.helpers import assert_close

EPS = 1e-6
LAYOUTS = {
    "per row, cuBLAS rows": Fp8InputLayout(group=1 << 20, row_multiple=4),
    "128 columns, cuBLAS": Fp8InputLayout(group=128, row_multiple=4, scales_row_index_fastest=True),
    "32 columns, kept": Fp8InputLayout(group=32, keep_unquantized=True),
    "48 columns (no kernel group)": Fp8InputLayout(group=48, row_multiple=4, keep_unquantized=True),
}


def variants(device, rows: int, hidden: int, dtype=torch.bfloat16):
    """(name, call(quantize) -> (normed, new residual or None)) for the four norms on one input."""
    x = (torch.randn(rows, hidden) * 3).to(dtype).to(device)
    residual = torch.randn(rows, hidden).to(dtype).to(device)
    weight = (torch.rand(hidden) + 0.5).to(dtype).to(device)
    terms = torch.randn(rows, 3, hidden).to(dtype).to(device)
    values = torch.randn(2 * rows + 1, hidden).to(dtype).to(device)
    term_rows = torch.randint(0, values.shape[0], (rows, 3), dtype=torch.int32, device=device)
    term_weights = torch.rand(rows, 3).to(dtype).to(device)
    return [
        ("rms_norm", lambda q: (kernels.rms_norm(x, weight, EPS, q), None)),
        ("fused_add", lambda q: kernels.fused_add_rms_norm(x, residual, weight, EPS, q)),
        ("fused_sum_add", lambda q: kernels.fused_sum_add_rms_norm(terms, residual, weight, EPS, q)),
        ("gathered_sum_add", lambda q: kernels.gathered_sum_add_rms_norm(
            values, term_rows, term_weights, residual, weight, EPS, q)),
    ]


def assert_same_fp8_input(actual: Fp8Input, expected: Fp8Input) -> None:
    assert isinstance(actual, Fp8Input)
    assert (actual.rows, actual.group, actual.dtype) == (expected.rows, expected.group, expected.dtype)
    assert actual.values.shape == expected.values.shape and actual.scale.shape == expected.scale.shape
    assert actual.scale.stride() == expected.scale.stride()
    assert torch.equal(actual.values.view(torch.uint8).cpu(), expected.values.view(torch.uint8).cpu())
    torch.testing.assert_close(actual.scale, expected.scale, rtol=0, atol=0)


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("rows,hidden", [(5, 320), (4, 64), (1, 40)])
def test_the_norm_writes_what_the_quantizer_makes_of_its_16_bit_rows(
        triton_device, poison_allocations, layout_name, rows, hidden):
    layout = LAYOUTS[layout_name]
    for name, call in variants(triton_device, rows, hidden):
        plain_normed, plain_residual = call(None)
        normed, new_residual = call(layout)
        assert_same_fp8_input(normed, quantize_fp8_input(plain_normed, layout))
        if layout.keep_unquantized:
            torch.testing.assert_close(normed.unquantized, plain_normed, rtol=0, atol=0, msg=name)
        else:
            assert normed.unquantized is None, name
        if plain_residual is not None:
            torch.testing.assert_close(new_residual, plain_residual, rtol=0, atol=0, msg=name)
        padded = layout.padded_rows(rows)
        assert normed.values.shape == (padded, hidden), name
        assert (normed.values[rows:].view(torch.uint8) == 0).all() and (normed.scale[rows:] == 1).all(), name


def test_the_quantized_rows_dequantize_to_the_16_bit_rows_within_e4m3_rounding(triton_device):
    # tolerance: e4m3 keeps 3 mantissa bits, so each value within 2**-4 of its own magnitude
    # (relative) of the 16-bit row, plus the group's smallest step near zero
    x = torch.randn(6, 256).to(torch.bfloat16).to(triton_device)
    weight = torch.ones(256, dtype=torch.bfloat16, device=triton_device)
    normed = kernels.rms_norm(x, weight, EPS, Fp8InputLayout(group=128, keep_unquantized=True))
    expected = normed.unquantized.float()
    torch.testing.assert_close(normed.dequantized(), expected, rtol=2.0**-4, atol=1e-2)


def test_the_reference_path_gives_the_same_layout(monkeypatch):
    # on CPU without Triton every norm is its reference, then the reference quantizer, in the layout
    monkeypatch.setenv("VLM_CATALOG_KERNELS", "reference")
    layout = LAYOUTS["128 columns, cuBLAS"]
    for name, call in variants(torch.device("cpu"), 5, 320):
        plain_normed, _ = call(None)
        normed, _ = call(layout)
        assert_same_fp8_input(normed, quantize_fp8_input(plain_normed, layout))
        assert normed.scale.stride() == (1, 8), name  # [8, 3] with the row index fastest


def test_an_empty_batch_gives_an_empty_input(triton_device):
    x = torch.empty(0, 64, dtype=torch.bfloat16, device=triton_device)
    normed = kernels.rms_norm(x, torch.ones(64, dtype=torch.bfloat16, device=triton_device), EPS,
                              LAYOUTS["per row, cuBLAS rows"])
    assert normed.rows == 0 and normed.values.shape == (0, 64) and normed.shape == (0, 64)


# --------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.fast_path("norm_quantizes")
@pytest.mark.parametrize("layout_name", ["per row, cuBLAS rows", "128 columns, cuBLAS"])
def test_gpu_the_norm_writes_what_the_quantizer_makes_of_its_16_bit_rows(cuda_device, layout_name):
    # Qwen3-VL-30B-A3B's hidden size, 4,099 rows (1 padding row to the cuBLAS multiple). Tolerance
    # 1e-2 of max |expected| on the dequantized rows and 1e-6 relative on the scales: the same
    # arithmetic (`quantize_rows`) on the same 16-bit rows, unless the compiler orders its float32
    # steps otherwise and an e4m3 value lands one step apart; the bits are expected to agree, and
    # the count of those that do not is printed.
    layout = LAYOUTS[layout_name]
    for name, call in variants(cuda_device, 4099, 2048):
        plain_normed, _ = call(None)
        normed, _ = call(layout)
        expected = quantize_fp8_input(plain_normed, layout)
        differing = (normed.values.view(torch.uint8) != expected.values.view(torch.uint8)).sum().item()
        print(f"{name} [{layout_name}]: {differing} of {normed.values.numel()} FP8 values differ in their bits")
        assert normed.values.shape == expected.values.shape and normed.scale.stride() == expected.scale.stride()
        torch.testing.assert_close(normed.scale, expected.scale, rtol=1e-6, atol=0)
        assert_close(normed.dequantized(), expected.dequantized(), rel=1e-2, what=name)
        assert (normed.values[4099:].view(torch.uint8) == 0).all() and (normed.scale[4099:] == 1).all()
