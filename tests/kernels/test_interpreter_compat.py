"""The interpreter work-arounds in `kernels.jit.interpreter_compat` make bfloat16 behave
as on a GPU: `tl.dot` on values (not bit patterns), float32 -> bfloat16 rounding to
nearest even; and loops with tensor bounds run on older Triton too."""

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


def test_loops_with_bounds_loaded_from_memory(triton_device):
    """`range(start, end)` with tensor bounds (the paged-attention split loops) under the
    interpreter: Triton < 3.9 on NumPy 2.4 failed here until the scalar __index__ patch."""
    if triton_device.type != "cpu":
        pytest.skip("checks the Triton interpreter only")
    import triton
    import triton.language as tl

    import kernels.jit  # noqa: F401  (applies the patch)

    @triton.jit
    def sum_between(values_ptr, bounds_ptr, out_ptr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        start = tl.load(bounds_ptr + 2 * row)
        end = tl.load(bounds_ptr + 2 * row + 1)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for tile in range(start, end, BLOCK):
            offsets = tile + tl.arange(0, BLOCK)
            total += tl.load(values_ptr + offsets, mask=offsets < end, other=0.0)
        tl.store(out_ptr + row, tl.sum(total))

    values = torch.arange(40, dtype=torch.float32)
    bounds = torch.tensor([[0, 40], [3, 17], [30, 31]], dtype=torch.int32)
    out = torch.empty(3)
    sum_between[(3,)](values, bounds, out, BLOCK=8)
    assert out.tolist() == [sum(range(40)), sum(range(3, 17)), 30.0]
