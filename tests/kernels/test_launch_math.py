"""The host's launch arithmetic (kernels/launch_math.py) against Triton's own functions, which it
replaces in launch code because their Python calls cost ~100x the arithmetic."""

import pytest

from kernels.launch_math import cdiv, next_power_of_2

triton = pytest.importorskip("triton")


def test_next_power_of_2_matches_triton():
    for n in [*range(0, 4100), 2**20 - 1, 2**20, 2**20 + 1, 151_936]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def test_cdiv_matches_triton():
    for numerator in [*range(0, 300), 27_000, 32_768, 151_936]:
        for denominator in (1, 2, 3, 16, 64, 128, 256, 1000):
            assert cdiv(numerator, denominator) == triton.cdiv(numerator, denominator), (numerator, denominator)


def test_triton_dtypes_of_the_float_dtypes_and_a_clear_error_otherwise():
    import torch
    import triton.language as tl

    from kernels.launch_math import triton_dtype

    assert [triton_dtype(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)] == [
        tl.float32, tl.bfloat16, tl.float16]
    with pytest.raises(ValueError, match="no Triton dtype for torch.int32"):
        triton_dtype(torch.int32)
