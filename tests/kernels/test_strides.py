"""The stride hint the wrappers pass to kernels (`kernels.strides`)."""

from __future__ import annotations

import pytest

from kernels.strides import common_power_of_two


@pytest.mark.parametrize(
    ("strides", "expected"),
    [((1152, 72, 3456), 8), ((2048, 128), 16), ((12, 4), 4), ((7, 16), 1), ((0,), 16), ((0, 36), 4)],
)
def test_the_hint_is_the_largest_power_of_two_dividing_every_stride(strides, expected):
    assert common_power_of_two(strides) == expected


def test_the_hint_never_exceeds_its_cap():
    assert common_power_of_two((1024, 2048), at_most=8) == 8
