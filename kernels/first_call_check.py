"""The first-call check of a faster path against the code it would replace.

Some ops prefer a faster path where it can run: cuBLAS's FP8 GEMMs (fp8_linear_cublas.py),
torch's grouped GEMMs for the MoE (moe/grouped_gemm.py), the vision MLP's GELU in cuBLASLt's
epilogue (linear_gelu.py). Each such path is checked once per shape against the code it
replaces before it is trusted: an error or a result too far from that code logs a warning and
the shape keeps the old code, so a path that fails on some GPU or library version slows a run
instead of failing it. The callers keep the verdicts per shape; this module only judges.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch


def faster_path_agrees(
    path: str,
    faster: Callable[[], torch.Tensor],
    expected: Callable[[], torch.Tensor],
    tolerance: float,
    log: logging.Logger,
    *,
    against: str,
    replaced: str,
) -> bool:
    """Whether `faster()` runs and lies within `tolerance` x max |expected()| of `expected()`.

    As the warnings say them: `path` names the faster path and its shape ("cuBLAS FP8 GEMM for
    weight (N, K) ..."), `against` what `expected` computes ("the reference"), `replaced` the
    code that runs instead where the check fails ("the Triton kernel"). NaN fails.
    """
    try:
        got = faster().float()
    except Exception as exc:  # noqa: BLE001 - any failure (a refused operand, a library error) keeps the old code
        log.warning("%s: unavailable (%s); %s runs", path, exc, replaced)
        return False
    reference = expected().float()
    error = ((got - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()
    if not error <= tolerance:  # NaN fails too
        log.warning("%s is %.3g (of max |%s|) from %s, above %g; %s runs",
                    path, error, against, against, tolerance, replaced)
        return False
    log.info("%s checked (error %.2g)", path, error)
    return True
