"""Zeroed int32 counters per device, for kernels whose last program to finish does a final step.

A kernel that splits work over programs and needs one more step over all of their results
(merging a split decode's partials, routing on a whole row of router logits) would take a
second launch. Instead each program counts its arrival with an atomic add (release-acquire at
GPU scope, after a CTA barrier), and the one that brings the count to the number of programs
does the step and puts its counter back to zero: the pattern of CUTLASS's split-K semaphores.
The paged decode kernel (`MERGE_IN_PLACE`) and the norm-and-router kernel (`ROUTE`) use these.

One buffer per device, allocated on the first eager call: a buffer allocated inside a CUDA-graph
capture would belong to the graph's pool, so there `arrival_counters` returns None and the
caller takes its two-launch path (the engine's graphs run each batch eagerly before capturing
it). Every launch leaves the counters at zero. Launches on one device share them, so two such
launches must not overlap (one stream, as the engine runs them).
"""

from __future__ import annotations

import torch

ARRIVAL_COUNTERS = 1 << 16  # counters per device: 256 KiB
_counters: dict[tuple[str, int | None], torch.Tensor] = {}


def arrival_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """The device's zeroed counters, or None where they cannot serve: more than the buffer holds
    (`ARRIVAL_COUNTERS` when it was made), or a capture before the first eager call."""
    key = (device.type, device.index if device.type != "cuda" or device.index is not None
           else torch.cuda.current_device())
    counters = _counters.get(key)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _counters[key] = torch.zeros(ARRIVAL_COUNTERS, dtype=torch.int32, device=device)
    return counters if needed <= counters.numel() else None
