"""The interpreter work-arounds in `kernels.jit.interpreter_compat` make bfloat16 behave
as on a GPU: `tl.dot` on values (not bit patterns), float32 -> bfloat16 rounding to
nearest even."""

from __future__ import annotations

import pytest
import torch


def test_bfloat16_dot_and_rounding(triton_device):
    if triton_device.type != "cpu":
        pytest.skip("checks the Triton interpreter only")
    import triton
    import triton.language as tl

    import kernels.jit  # noqa: F401  (applies the patch)

    @triton.jit
    def dot_and_round(a_ptr, b_ptr, dot_ptr, values_ptr, rounded_ptr, N: tl.constexpr):
        rows, cols = tl.arange(0, N)[:, None], tl.arange(0, N)[None, :]
        a = tl.load(a_ptr + rows * N + cols)
        b = tl.load(b_ptr + rows * N + cols)
        tl.store(dot_ptr + rows * N + cols, tl.dot(a, b))
        values = tl.load(values_ptr + rows * N + cols)
        tl.store(rounded_ptr + rows * N + cols, values.to(tl.bfloat16))

    size = 16
    a = torch.randn(size, size).to(torch.bfloat16)
    b = torch.randn(size, size).to(torch.bfloat16)
    values = torch.randn(size, size)
    # exact ties between two bfloat16 neighbours must round to the even one
    values.view(-1)[:4] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.0 + 2**-7])
    dot = torch.empty(size, size)
    rounded = torch.empty(size, size, dtype=torch.bfloat16)
    dot_and_round[(1,)](a, b, dot, values, rounded, N=size)
    torch.testing.assert_close(dot, a.float() @ b.float(), rtol=1e-6, atol=1e-6)
    assert torch.equal(rounded, values.to(torch.bfloat16)), (
        "float32 -> bfloat16 must round like torch"
    )
