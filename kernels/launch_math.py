"""Arithmetic for kernel launches on the host (grids, block sizes, dtype constexprs).

`triton.cdiv` and `triton.next_power_of_2` are constexpr functions: called from Python each
goes through Triton's constexpr wrapper, about 5.5 us a call on this project's CPU machine
(Triton 3.6 and 3.9 alike) against 0.06 us for the arithmetic itself. A decode layer's launches
made about ten such calls, each eager step 48 times over. These give the same results for the
non-negative integers launch code passes (tests/kernels/test_launch_math.py).
"""

import functools


def cdiv(numerator: int, denominator: int) -> int:
    """`numerator / denominator` rounded up, as `triton.cdiv`."""
    return (numerator + denominator - 1) // denominator


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= `n` (0 for 0), as `triton.next_power_of_2`."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@functools.cache
def triton_dtype(dtype):
    """The `triton.language` dtype of a torch floating dtype, for a dtype constexpr (a kernel that
    rounds to a dtype none of its pointers has); cached, as every launch asks."""
    import torch
    import triton.language as tl

    dtypes = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    if dtype not in dtypes:
        raise ValueError(f"no Triton dtype for {dtype}: expected one of {sorted(map(str, dtypes))}")
    return dtypes[dtype]
