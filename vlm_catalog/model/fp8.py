"""FP8 block-quantized weights: the format of Qwen's "-FP8" checkpoints.

A weight W [N, K] is stored as float8 e4m3 values Q and one float32 scale per
block of `block_n x block_k` elements, in `<name>.weight_scale_inv`
[ceil(N / block_n), ceil(K / block_k)]. Despite the name the scale multiplies:
W = Q * scale, each scale repeated over its block. config.json announces it:

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                            "weight_block_size": [128, 128], "activation_scheme": "dynamic",
                            "modules_to_not_convert": [...]}

The loader either widens such weights to the model's dtype (exact: e4m3 x a
float32 scale fits bfloat16's range, the product is rounded once), or keeps the
MoE experts' weights in FP8 with their scales, which halves their memory and
the bytes a decode step reads (`kernels.fused_moe` widens them tile by tile).
Activations stay in the model's dtype ("W8A16") unless `--quantization
fp8_w8a8`, which also holds the decoder's dense projections in FP8 and
quantizes every FP8 GEMM's input (`text.Fp8Linear`, kernels/fp8_linear.py). The quantization math is in
kernels/fp8.py.
"""

from __future__ import annotations

from dataclasses import dataclass

# how a model holds its weights (`quantization`, vlm_catalog/model/loader.py's module doc)
QUANTIZATION_MODES = ("auto", "fp8", "fp8_w8a8", "fp8_w8a8_channel", "none")
W8A8_MODES = ("fp8_w8a8", "fp8_w8a8_channel")  # FP8 dense projections and FP8 GEMM inputs


@dataclass(frozen=True)
class Fp8BlockQuantization:
    """`quantization_config` of a block-quantized FP8 checkpoint (see the module doc)."""

    block_n: int = 128
    block_k: int = 128

    @property
    def block(self) -> tuple[int, int]:
        return self.block_n, self.block_k

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return -(-rows // self.block_n), -(-cols // self.block_k)


def fitting_block(*row_counts: int) -> Fp8BlockQuantization:
    """Blocks for quantizing unquantized weights: 128 x 128 as Qwen's, with rows cut to the
    largest power of two (>= 16) dividing every count in `row_counts` (fused weights, e.g. the
    stacked expert gate/up or the q/k/v projections, need whole blocks per part)."""
    rows = 128
    while any(count % rows for count in row_counts) and rows > 16:
        rows //= 2
    return Fp8BlockQuantization(block_n=rows, block_k=128)
