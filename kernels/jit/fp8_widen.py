"""Widening float8 e4m3 inside kernels, faster than Triton's own cast: weights to bfloat16 in
the GEMMs (`widen_e4m3`), and an FP8 KV cache's V rows to float16 in the paged decode
attention (`e4m3_words_to_float16`, with `saturate_float16` for its query).

Triton widens e4m3 to bf16 through float16: one packed conversion per pair, then
one scalar f16 -> bf16 conversion per element, on a pipe the CUDA guide rates at
16 per clock per SM. `widen_e4m3` keeps the packed conversion and moves
each pair's bits into bf16's fields with four 32-bit integer instructions and
one packed bf16 multiply (inline PTX, sm_90). The result is exact: every e4m3
value is a normal float16 whose mantissa ends in (at least) three zero bits, so
shifting the float16 exponent and mantissa right by three places them in bf16's
fields with the exponent biased 112 too low (bf16 127 against float16 15), and
the multiply by 2^112 (exact: a power of two) restores it; zero stays zero. An
e4m3 NaN would come out as a large finite number; the weights are quantized
with saturation and hold none.

Where: the GEMMs over FP8 weights with bf16 inputs (W8A16: the fused MoE's FP8
experts, the dense `fp8_linear`). In their sm_90 SASS the widening took 128
scalar conversions per loop iteration of the MoE's gate/up GEMM at T <= 256;
it now takes integer and packed-multiply instructions instead (the loop issues
about 6% more of them, none on the conversion pipe). Not yet run on a GPU:
`pytest -m gpu` checks it there, and `VLM_CATALOG_KERNELS_OFF=fp8_widen_ptx`
turns it off (`kernels/dispatch.py`).
"""

import triton
import triton.language as tl

SIGN_BITS = 0x80008000  # the sign of both halves of a float16 (or bf16) pair
MAGNITUDE_BITS = 0x7FFF7FFF
FIELD_SHIFT = 3  # float16's 10 mantissa bits -> bf16's 7
BF16_TWO_POW_112 = 0x7780  # bf16 bits of 2^112 (exponent 112 + 127 = 239)

WIDEN_ASM = tl.constexpr(
    "{ .reg .b32 f, s, c; .reg .b16 l, h; mov.b32 {l, h}, $2; "
    f"mov.b32 c, 0x{(BF16_TWO_POW_112 << 16) | BF16_TWO_POW_112:08X}; "
    + "".join(
        f"cvt.rn.f16x2.e4m3x2 f, {half}; and.b32 s, f, 0x{SIGN_BITS:08X}; and.b32 f, f, 0x{MAGNITUDE_BITS:08X}; "
        f"shr.b32 f, f, {FIELD_SHIFT}; or.b32 f, f, s; mul.rn.bf16x2 ${out}, f, c; "
        for out, half in ((0, "l"), (1, "h"))
    )
    + "}"
)


@triton.jit
def widen_e4m3(x, dtype: tl.constexpr, WITH_PTX: tl.constexpr):
    """e4m3 `x` widened to `dtype` (exact). WITH_PTX and bfloat16: four values per inline-PTX
    block (module docstring); else Triton's cast (the interpreter runs no PTX)."""
    if WITH_PTX and dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(asm=WIDEN_ASM, constraints="=r,=r,r", args=[x.to(tl.uint8, bitcast=True)],
                                         dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        return x.to(dtype)


@triton.jit
def e4m3_words_to_float16(words, WITH_PTX: tl.constexpr):
    """[R, W] int32 of four e4m3 values each, the lowest byte first -> [R, 4 W] float16 (exact).

    On the GPU (WITH_PTX) sm_89's packed conversion widens two values per instruction. The
    interpreter, which runs no PTX, takes each byte through Triton's own conversion; the
    rest (the word loads, the order of the values) is the same code on both."""
    if WITH_PTX:
        v0, v1, v2, v3 = tl.inline_asm_elementwise(
            asm="{ .reg .b32 a, b; .reg .b16 l, h; mov.b32 {l, h}, $4; cvt.rn.f16x2.e4m3x2 a, l; "
                "cvt.rn.f16x2.e4m3x2 b, h; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
            constraints="=h,=h,=h,=h,r", args=[words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=1)
    else:
        v0 = (words & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        v1 = ((words >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        v2 = ((words >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        v3 = ((words >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    # join adds a last axis: [R, W, 2] -> [R, W, 2, 2], where [r, w, i, j] is value 4 w + 2 i + j
    quads = tl.join(tl.join(v0, v2), tl.join(v1, v3))
    return tl.reshape(quads, (words.shape[0], words.shape[1] * 4))  # [R, 4 W]


@triton.jit
def saturate_float16(x):
    """`x` in float16, clamped to its range (+-65504) first: a 16-bit query for the float16 dots
    over an FP8 cache stays finite (jit/paged_decode_attention.py)."""
    return tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
