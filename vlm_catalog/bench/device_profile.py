"""Where a run's device time goes: a torch.profiler trace summed by region and kind of kernel.

`profile_breakdown(profiler, on_cuda)` reads a finished `torch.profiler.profile`:

- **region**: the innermost `vlm.*` mark around the launch. The engine's device
  timers mark their calls (`DeviceTimer(label=...)`): `vlm.vision_encoder`,
  `vlm.text_forward.prefill`, `vlm.text_forward.decode` (a CUDA graph's replay
  where one is captured) and `vlm.step` (the rest of a step: sampling, masks,
  uploads). A kernel launched outside every mark is `unmarked`.
- **kind**: what the kernel does, from its name (`KERNEL_KINDS`, first match):
  attention, MoE, GEMM, norm and rotary, quantize, copies, else `other`.
- **busy**: the union of the kernels' intervals, against the profiled wall time:
  what is left is the device waiting for the host.

On CUDA the units are the device's kernels, each charged to the region of the host
event it is linked to (CUPTI's correlation: the op or mark it was launched under).
A kernel linked to no host event (seen on the H200 of 2026-11-27: the Triton
kernels and the CUDA graphs' replayed kernels, 4.36 of 7.88 busy seconds, had
dropped out of every region) is charged to the innermost mark that kineto drew
on the device's timeline around it, else to `unmarked`; `unlinked_kernel_seconds`
says how much was charged that way. On a CPU there are no kernels, and each
torch op's own CPU time stands in, so the same code runs in CI.
"""

from __future__ import annotations

import re
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from typing import TypeVar

import torch
from torch.autograd import DeviceType

T = TypeVar("T")

REGION_PREFIX = "vlm."
UNMARKED = "unmarked"

# (kind, pattern over the kernel's name, lower-cased), first match wins: our Triton kernels by
# their jit function names, cuBLAS / FlashAttention / PyTorch's by their library names
KERNEL_KINDS: tuple[tuple[str, re.Pattern], ...] = tuple(
    (kind, re.compile(pattern))
    for kind, pattern in (
        ("attention", r"attention|attn|flash|fmha|paged_decode|paged_prefill|sdpa|softmax_kernel"),
        ("moe", r"moe|route_topk"),
        ("gemm", r"gemm|nvjet|xmma|cutlass|fp8_linear|scaled_mm|matmul|aten::mm|aten::addmm|aten::bmm|aten::linear"),
        ("norm_rotary", r"norm|rope|rotary"),
        ("quantize", r"quant"),
        ("copy", r"memcpy|memset|copy_"),
    )
)
TOP_KERNELS = 12  # per region


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    for kind, pattern in KERNEL_KINDS:
        if pattern.search(lowered):
            return kind
    return "other"


def _is_mark(name: str) -> bool:
    """A region mark (kineto also draws the marks on the device's timeline, as ranges that span
    their kernels and the gaps between them: neither a kernel nor busy time)."""
    return name.startswith(REGION_PREFIX)


def region_of(event) -> str:
    """The innermost `vlm.*` mark at or above a profiler event (its CPU parents)."""
    while event is not None:
        if event.name.startswith(REGION_PREFIX):
            return event.name
        event = event.cpu_parent
    return UNMARKED


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (any order, any overlap)."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def device_kernels(events) -> list:
    """The device's kernels (and copies) among a trace's events: not the marks' ranges on its timeline."""
    return [event for event in events
            if event.device_type == DeviceType.CUDA and not getattr(event, "is_user_annotation", False)
            and not _is_mark(event.name)]


def charged_kernels(events, kernels) -> tuple[list[tuple[str, str, float]], float]:
    """(region, name, microseconds) per kernel, and the microseconds charged without a host link.

    A kernel's `linked_correlation_id` is the id of the host op or mark it was launched under.
    Unlinked kernels go to the innermost device-side mark around their start, found in one sweep
    over both sorted by start (marks nest: a step's mark holds its forward's)."""
    hosts = {event.id: event for event in events
             if event.device_type == DeviceType.CPU and not getattr(event, "linked_correlation_id", 0)}
    marks = sorted((event.time_range.start, -event.time_range.end, event.name) for event in events
                   if event.device_type == DeviceType.CUDA and _is_mark(event.name))
    units: list[tuple[str, str, float]] = []
    unlinked = 0.0
    open_marks: list[tuple[float, str]] = []  # (end, name), innermost last
    next_mark = 0
    for kernel in sorted(kernels, key=lambda event: event.time_range.start):
        start, micros = kernel.time_range.start, kernel.time_range.end - kernel.time_range.start
        host = hosts.get(getattr(kernel, "linked_correlation_id", 0))
        while next_mark < len(marks) and marks[next_mark][0] <= start:
            mark_start, negative_end, name = marks[next_mark]
            while open_marks and open_marks[-1][0] <= mark_start:
                open_marks.pop()
            open_marks.append((-negative_end, name))
            next_mark += 1
        while open_marks and open_marks[-1][0] <= start:
            open_marks.pop()
        if host is not None:
            region = region_of(host)
        else:
            region = open_marks[-1][1] if open_marks else UNMARKED
            unlinked += micros
        units.append((region, kernel.name, micros))
    return units, unlinked


def profile_breakdown(profiler, on_cuda: bool, wall_seconds: float) -> dict:
    """The profiled run's kernel time by region and kind, its largest kernels per region, and how
    busy the device was over `wall_seconds` (see the module docstring)."""
    by_region: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    by_name: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    intervals: list[tuple[float, float]] = []
    events = profiler.events()
    unlinked = 0.0
    if on_cuda:
        kernels = device_kernels(events)
        units, unlinked = charged_kernels(events, kernels)
        intervals = [(kernel.time_range.start, kernel.time_range.end) for kernel in kernels]
    else:
        units = []
        for event in events:
            # on CPU a mark's own time is Python, not an op
            if event.device_type != DeviceType.CPU or _is_mark(event.name) or event.self_cpu_time_total <= 0:
                continue
            units.append((region_of(event), event.name, event.self_cpu_time_total))
            intervals.append((event.time_range.start, event.time_range.end))
    for region, name, micros in units:
        by_region[region][kernel_kind(name)] += micros
        totals = by_name[region][name[:160]]
        totals[0] += micros
        totals[1] += 1
    busy = union_seconds(intervals) / 1e6
    regions = {}
    for region, kinds in sorted(by_region.items(), key=lambda item: -sum(item[1].values())):
        top = sorted(by_name[region].items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
        regions[region] = {
            "seconds": sum(kinds.values()) / 1e6,
            "kinds": {kind: micros / 1e6 for kind, micros in sorted(kinds.items(), key=lambda item: -item[1])},
            "top": [{"name": name, "seconds": micros / 1e6, "calls": calls} for name, (micros, calls) in top],
        }
    return {
        "time": "device kernels" if on_cuda else "cpu (torch ops' own time)",
        "wall_seconds": wall_seconds,
        "busy_seconds": busy,
        "busy_fraction": busy / wall_seconds if wall_seconds > 0 else None,
        "kernel_seconds": sum(region["seconds"] for region in regions.values()),
        "unlinked_kernel_seconds": unlinked / 1e6,  # charged by the device-side marks (module docstring)
        "regions": regions,
    }


def profiled_call(call: Callable[[], T], device: torch.device) -> tuple[T, dict]:
    """`call()` under torch.profiler (the device's kernels on CUDA, the ops on CPU): its result,
    and `profile_breakdown` of it with the analysis's own seconds. If the profiler fails (no
    CUPTI, say), the error is the breakdown and the call's result still stands (run unprofiled
    if the profiler failed before it)."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    stage = "starting"  # the profiler's, then the call's, then the profiler's again
    try:
        started = time.perf_counter()
        with profile(activities=activities) as profiler:
            stage = "calling"
            result = call()
            stage = "analysing"
            if on_cuda:
                torch.cuda.synchronize(device)
        wall = time.perf_counter() - started
        analysed = time.perf_counter()
        breakdown = profile_breakdown(profiler, on_cuda, wall)
        breakdown["analysis_seconds"] = time.perf_counter() - analysed
    except Exception as exc:  # noqa: BLE001 - the profiler's failure: reported, the call's result kept
        if stage == "calling":  # the call's own error
            raise
        traceback.print_exc()
        if stage == "starting":
            result = call()
        breakdown = {"error": f"{type(exc).__name__}: {exc}"}
    return result, breakdown
