"""Stride facts the wrappers pass to kernels as compile-time hints.

Triton's launcher marks an integer argument divisible by 16 when it is one; a stride
that is a multiple of 8 but not of 16 (the vision tower's head stride of 72) gets
no mark, and a kernel indexing with it loads one element at a time. A kernel given
the multiple below applies it with `tl.multiple_of` to its row offsets, and its
loads vectorize again.
"""

from __future__ import annotations


def common_power_of_two(values: tuple[int, ...], at_most: int = 16) -> int:
    """The largest power of two, at most `at_most`, that divides every value (0 is
    divisible by anything): a safe `tl.multiple_of` hint for these strides."""
    multiple = at_most
    while multiple > 1 and any(value % multiple for value in values):
        multiple //= 2
    return multiple
