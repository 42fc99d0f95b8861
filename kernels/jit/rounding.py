"""Rounding a float32 value to a 16-bit float and back, as a GEMM's epilogue needs it.

`x.to(tl.bfloat16).to(tl.float32)` computes this, but when two values rounded that
way are multiplied and the product is rounded again, LLVM (as Triton 3.9 bundles
it) narrows the float32 multiply to a 16-bit one (`mul.bf16`, `mul.f16`).
That is exact: the float32 product of two 16-bit floats needs at most 22 of
float32's 24 significand bits, so one rounding of it is the 16-bit product. But in
the fused MoE's epilogues, those 16-bit multiplies of accumulator registers made
ptxas serialize the K loop's wgmma (its note C7514: "non wgmma instructions
reading accumulator registers of a wgmma between start and end of the pipeline
stage"): every wgmma of the 16-bit GEMMs at prefill tiles waited for the one
before it. Triton 3.6 did the same to the float16 gate/up GEMM, not to the bf16
ones. `round_through` widens back by integer arithmetic on the bits instead, which
LLVM cannot see through.
"""

import triton
import triton.language as tl

F16_TO_F32_SCALE = tl.constexpr(2.0**112)  # 2^(127 - 15): float16 bits shifted into float32's places, re-biased


@triton.jit
def round_through(x, dtype: tl.constexpr):
    """float32 `x` rounded to `dtype` (to nearest, ties to even) and widened back: the value of
    `x.to(dtype).to(tl.float32)`, NaN for NaN (the payload may differ)."""
    if dtype == tl.bfloat16:
        # the upper half of the bits after adding half a unit of the last kept place (plus one
        # where that place is odd); the carry moves into the exponent as rounding does
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # a NaN's payload could carry into the sign
    elif dtype == tl.float16:
        half = x.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
        # exponent and mantissa moved to float32's places, then re-biased by one multiply
        # (exact for normal and subnormal values alike); infinities and NaNs keep an all-ones exponent
        shifted = (half & 0x7FFF) << 13
        finite = (shifted.to(tl.float32, bitcast=True) * F16_TO_F32_SCALE).to(tl.uint32, bitcast=True)
        magnitude = tl.where((half & 0x7C00) == 0x7C00, shifted | 0x7F800000, finite)
        return (magnitude | ((half & 0x8000) << 16)).to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)
