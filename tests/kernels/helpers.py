"""Comparison helpers for the kernel tests."""

from __future__ import annotations

import torch

# relative tolerances (max-norm: max |actual - expected| / max |expected|)
FLOAT32_TOLERANCE = 1e-4
HALF_TOLERANCE = 1e-2  # bfloat16 / float16: a few units of the 8-bit (bf16) mantissa
TOLERANCE = {
    torch.float32: FLOAT32_TOLERANCE,
    torch.float16: HALF_TOLERANCE,
    torch.bfloat16: HALF_TOLERANCE,
    torch.float64: 1e-10,
}


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str = "output"
) -> None:
    """Same shape, no NaN/inf where `expected` is finite, and
    max |actual - expected| <= rel * max |expected| (+ a tiny floor for all-zero outputs)."""
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    actual64, expected64 = actual.detach().cpu().double(), expected.detach().cpu().double()
    assert torch.isfinite(actual64).all(), f"{what}: has NaN/inf (an element was not written?)"
    scale = expected64.abs().max().item() if expected64.numel() else 0.0
    error = (actual64 - expected64).abs().max().item() if expected64.numel() else 0.0
    assert error <= rel * scale + 1e-12, (
        f"{what}: max abs error {error:.3e} > {rel:.0e} x max |expected| {scale:.3e} "
        f"(relative {error / max(scale, 1e-30):.2e})"
    )
