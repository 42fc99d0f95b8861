"""`gelu_tanh(x @ weight.T + bias)` with the GELU in the GEMM's epilogue on CUDA: the vision
MLP's first projection (`linear_fc1`, hidden 1152 -> 4304 at the 30B-A3B shapes).

Done apart, the projection writes its [N, 4304] result, the GELU reads it back and writes
it again: at the engine run's 1.16M patches and 27 blocks about 540 GB of memory traffic,
some 0.18 s on an H100. On CUDA, torch's `_addmm_activation(bias, x, weight.T, use_gelu=True)`
runs cuBLASLt's GELU_BIAS epilogue, which adds the bias and applies the tanh-approximated
GELU (`gelu_pytorch_tanh`, the checkpoint's `hidden_act`) to the float32 accumulator before
its one write. Where cuBLASLt cannot take a call, torch runs the GEMM and then the same
tanh GELU, so the function is the same either way.

Elsewhere the reference runs, `F.gelu(F.linear(x, weight, bias), approximate="tanh")`:
`_addmm_activation`'s CPU kernel applies the exact (erf) GELU instead, a different function.

Numerics: the epilogue applies the GELU to the float32 sum, the reference to the sum rounded
to bf16 first; the two differ by about one bf16 unit of the output
(tests/kernels/test_linear_gelu.py: 1e-2 of max |expected|, HALF_TOLERANCE).

The first call for each (device, weight shape, dtype) checks the epilogue against the
reference on the first PROBE_ROWS rows of its input (`_matches_reference`: PROBE_TOLERANCE of
max |reference|; kernels/first_call_check.py). An error or a mismatch logs a warning and that
shape keeps the reference, so a cuBLASLt that refuses or gets it wrong slows the vision tower
instead of failing it.

Off switch: ``VLM_CATALOG_KERNELS_OFF=gelu_gemm_epilogue`` (the reference on CUDA too).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kernels.checks import dtype_name
from kernels.dispatch import kernel_backend, kernels_off
from kernels.first_call_check import faster_path_agrees

OFF_SWITCH = "gelu_gemm_epilogue"  # the name VLM_CATALOG_KERNELS_OFF takes
EPILOGUE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# where `_addmm_activation`'s GELU is the tanh one (not kernels.dispatch.AUTO_DEVICE_TYPES, which
# tests widen to "cpu" to run the Triton choices interpreted: on CPU this would change the function)
EPILOGUE_DEVICE_TYPES = ("cuda",)
PROBE_TOLERANCE = 2e-2  # of max |reference|: one bf16 unit of rounding before or after the GELU, with margin
# the check's rows (of the first call's input): both results and their float32 copies stay small
# (the whole first call, 65k patches at 16k-token steps, would hold some 3 GB more at once)
PROBE_ROWS = 256

logger = logging.getLogger(__name__)
# the first-call check's verdict per (device, weight shape, dtype)
_checked: dict[tuple, bool] = {}


def linear_gelu_tanh_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The projection, rounded to x's dtype, then the tanh-approximated GELU: [..., out]."""
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


def linear_gelu_tanh_epilogue(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The same through `torch._addmm_activation` (GELU in cuBLASLt's epilogue on CUDA): [N, out]."""
    return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)


def epilogue_wanted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a call takes the epilogue: a 2-D input and a bias (what addmm's epilogue takes), one
    dtype throughout, on a device where `_addmm_activation`'s GELU is the tanh one (CUDA), not
    under the `reference` backend, not turned off, and no gradient wanted (training keeps the
    reference's autograd)."""
    return (
        bias is not None
        and x.dim() == 2
        and x.shape[0] > 0  # no rows: nothing to gain, nor to check the epilogue on
        and x.dtype == weight.dtype == bias.dtype
        and x.dtype in EPILOGUE_DTYPES
        and all(t.device.type in EPILOGUE_DEVICE_TYPES for t in (x, weight, bias))
        and kernel_backend() != "reference"
        and OFF_SWITCH not in kernels_off()
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight, bias)))
    )


def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`gelu_tanh(x @ weight.T + bias)`: x [N, in], weight [out, in], bias [out] -> [N, out]."""
    if not epilogue_wanted(x, weight, bias):
        return linear_gelu_tanh_reference(x, weight, bias)
    key = (x.device, tuple(weight.shape), x.dtype)
    verdict = _checked.get(key)
    if verdict is None:  # the first call of this shape checks it on its first rows
        verdict = _checked[key] = _matches_reference(x[:PROBE_ROWS], weight, bias)
    if verdict:
        return linear_gelu_tanh_epilogue(x, weight, bias)
    return linear_gelu_tanh_reference(x, weight, bias)


def verdicts() -> dict[str, bool]:
    """The first-call checks of this process so far: "(out, in) dtype" -> whether the epilogue runs."""
    return {f"{shape} {dtype_name(dtype)}": verdict for (_, shape, dtype), verdict in _checked.items()}


def _matches_reference(probe: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> bool:
    return faster_path_agrees(
        f"the GELU GEMM epilogue for weight {tuple(weight.shape)} {dtype_name(probe.dtype)}",
        lambda: linear_gelu_tanh_epilogue(probe, weight, bias), lambda: linear_gelu_tanh_reference(probe, weight, bias),
        PROBE_TOLERANCE, logger, against="the reference", replaced="F.linear then F.gelu")
