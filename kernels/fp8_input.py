"""A W8A8 GEMM's FP8 input, written ahead by the kernel before the GEMM.

A W8A8 GEMM quantizes its 16-bit input first (`kernels.fp8.quantize_activations`): one
read of [T, K] and one write of its bytes. In the decoder the input of q/k/v and of the
experts is an RMSNorm's output, and the norm holds each whole row in one program. So the
norm can write the FP8 values and their scales itself (`kernels.rms_norm`, `quantize=`):
the 16-bit output is then never read again, and for q/k/v never written at all (at a
16k-token step, 134 MB less traffic per layer for q/k/v and 67 MB for the experts).

The GEMM says how it wants its input (`Fp8InputLayout`): the column group of each scale,
the rows padded to a multiple (cuBLAS's 4, as `fp8_linear_cublas.cublas_operands` pads
them: zero rows of scale 1), the scales' strides, and whether the 16-bit tensor is kept
too (the MoE's router reads it). The writer hands back an `Fp8Input`. Its values and
scales are the bits `quantize_activations` gives for the 16-bit rows the writer would
have written, so the GEMM's answer is the same bit for bit.

``VLM_CATALOG_KERNELS_OFF=norm_quantizes`` stops the GEMMs from asking (`wanted`): the
norms then write 16 bits and the GEMMs quantize, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.dispatch import kernels_off
from kernels.fp8 import FP8_DTYPE, dequantize_activations, quantize_activations

OFF_SWITCH = "norm_quantizes"  # the name VLM_CATALOG_KERNELS_OFF takes


@dataclass(frozen=True)
class Fp8InputLayout:
    """How a GEMM wants its FP8 input laid out (module doc)."""

    group: int  # columns per scale; at least K: one scale per row
    row_multiple: int = 1  # rows padded to a multiple of this with zero rows of scale 1
    scales_row_index_fastest: bool = False  # scales [R, G] with strides (1, R), as cuBLAS's 1x128 recipe takes
    keep_unquantized: bool = False  # the writer keeps its 16-bit output too

    def __post_init__(self) -> None:
        if self.group < 1 or self.row_multiple < 1:
            raise ValueError(f"Fp8InputLayout: group and row_multiple must be positive, got {self}")

    def padded_rows(self, rows: int) -> int:
        return -(-rows // self.row_multiple) * self.row_multiple

    def num_groups(self, cols: int) -> int:
        return -(-cols // self.group)


@dataclass(frozen=True)
class Fp8Input:
    """Rows [R, K] quantized for a W8A8 GEMM: values [R_pad, K] e4m3 and scales [R_pad, G] float32
    (dequantization multipliers, one per row and `group` columns), rows R..R_pad zero with scale
    1; `unquantized` the 16-bit rows [R, K] where the layout kept them."""

    values: torch.Tensor
    scale: torch.Tensor
    rows: int
    group: int
    dtype: torch.dtype  # the 16-bit dtype the rows were rounded to before quantizing (the GEMM's output)
    unquantized: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.values.shape[1]))

    @property
    def device(self) -> torch.device:
        return self.values.device

    def dequantized(self) -> torch.Tensor:
        """Values x scales in float32 [R, K]: what a W8A8 GEMM multiplies (`kernels.fp8.gemm_input`)."""
        return dequantize_activations(self.values[:self.rows], self.scale[:self.rows], self.group)

    def row_range(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [end - start, K], scales [end - start, G]) of rows start..end."""
        return self.values[start:end], self.scale[start:end]


def wanted() -> bool:
    """Whether GEMMs may ask their inputs' writers to quantize (not turned off by name)."""
    return OFF_SWITCH not in kernels_off()


def empty_fp8_input(rows: int, cols: int, layout: Fp8InputLayout,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (values [R_pad, K] e4m3, scales [R_pad, G] float32) in `layout`'s strides."""
    padded, groups = layout.padded_rows(rows), layout.num_groups(cols)
    values = torch.empty((padded, cols), dtype=FP8_DTYPE, device=device)  # [R_pad, K]
    if layout.scales_row_index_fastest:
        scale = torch.empty((groups, padded), dtype=torch.float32, device=device).t()  # [G, R_pad] -> [R_pad, G]
    else:
        scale = torch.empty((padded, groups), dtype=torch.float32, device=device)  # [R_pad, G]
    return values, scale


def fill_padding(values: torch.Tensor, scale: torch.Tensor, rows: int) -> None:
    """Rows `rows`.. of an FP8 input: zeros with scale 1 (they add nothing to the GEMM)."""
    if values.shape[0] > rows:
        values[rows:].zero_()
        scale[rows:].fill_(1.0)


def quantize_fp8_input(x: torch.Tensor, layout: Fp8InputLayout) -> Fp8Input:
    """x [R, K] 16-bit quantized into `layout` (`quantize_activations`), its padding rows filled."""
    rows, cols = x.shape
    values, scale = empty_fp8_input(rows, cols, layout, x.device)
    if rows:
        quantize_activations(x, layout.group, values[:rows], scale[:rows])
    fill_padding(values, scale, rows)
    return Fp8Input(values, scale, rows, layout.group, x.dtype, x if layout.keep_unquantized else None)


def rows_of(x: torch.Tensor | Fp8Input) -> int:
    """The row count of a GEMM input, 16-bit [R, K] or quantized."""
    return x.rows if isinstance(x, Fp8Input) else x.shape[0]
