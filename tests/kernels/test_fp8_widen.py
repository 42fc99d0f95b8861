"""Widening e4m3 to bf16 by inline PTX (kernels/jit/fp8_widen.py).

The PTX runs only on a GPU (`pytest -m gpu`: the FP8 expert and dense-linear
tests there take it). Here: the bit arithmetic it performs, on every pair of
e4m3 values, with the module's own constants; and when a launch takes it.
"""

from __future__ import annotations

import pytest
import torch

from kernels import dispatch

fp8_widen = pytest.importorskip("kernels.jit.fp8_widen")


def _widened_pairs(words: torch.Tensor) -> torch.Tensor:
    """What the PTX computes from 32-bit words holding two float16 values each (the packed
    conversion's output): int64 [N] -> bf16 bits as int64 [N, 2], low half first."""
    sign = words & fp8_widen.SIGN_BITS
    fields = ((words & fp8_widen.MAGNITUDE_BITS) >> fp8_widen.FIELD_SHIFT) | sign  # one shift for both halves
    return torch.stack([fields & 0xFFFF, fields >> 16], dim=1)


def _float16_bits(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 codes -> their float16 bits as int64 (what the packed conversion writes)."""
    return codes.view(torch.float8_e4m3fn).to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF


def test_the_bit_arithmetic_widens_every_e4m3_pair_exactly():
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # all but the NaNs
    low, high = torch.meshgrid(codes, codes, indexing="ij")  # every ordered pair
    low, high = low.reshape(-1), high.reshape(-1)
    words = _float16_bits(low) | (_float16_bits(high) << 16)  # cvt.rn.f16x2.e4m3x2's result
    bf16_bits = _widened_pairs(words)  # [N, 2]
    # the packed multiply by 2^112, in float32 (exact: a power of two, and every result is a bf16)
    rebias = torch.tensor([fp8_widen.BF16_TWO_POW_112 << 16], dtype=torch.int32).view(torch.float32)
    widened = (bf16_bits.to(torch.int32) << 16).view(torch.float32) * rebias
    expected = torch.stack([low, high], dim=1).view(torch.float8_e4m3fn).to(torch.float32)
    assert rebias.item() == 2.0**112
    assert torch.equal(widened, expected)
    assert torch.equal(torch.signbit(widened), torch.signbit(expected))  # -0 stays -0


def test_ptx_widening_only_for_gpu_compiles_and_only_while_on(monkeypatch):
    from triton.runtime.jit import JITFunction

    def kernel(x):
        pass

    compiled = JITFunction(kernel)  # what @triton.jit returns without the interpreter
    monkeypatch.delenv(dispatch.KERNELS_OFF_ENV_VAR, raising=False)
    assert dispatch.widens_with_ptx(compiled)
    assert not dispatch.widens_with_ptx(kernel)  # an interpreted kernel is no JITFunction
    monkeypatch.setenv(dispatch.KERNELS_OFF_ENV_VAR, "fp8_widen_ptx")
    assert not dispatch.widens_with_ptx(compiled)
