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
- **idle** (CUDA only): where inside the marks the device waited. Every stretch
  between two kernels that no kernel covers is charged to the innermost mark that
  kineto drew around it on the device's timeline (`idle_seconds` per region; a
  stretch outside every mark, between steps, is `unmarked`), and the longer ones
  (`WAIT_MIN_MICROS` and up) are summed by the kernel before them and the host op
  that launched the kernel after (`waits`): where the host, not the device, was the
  critical path. The profiler slows the host, so a profiled run shows more of
  these than an unprofiled one; where they fall is the lead.

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

import bisect
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
# a stretch of idle device time this long or longer is a wait for the host, not the ~1 us between
# two kernels that were queued in time; the longest are listed per region
WAIT_MIN_MICROS = 10.0
TOP_WAITS = 8


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


def kineto_links(profiler) -> dict[tuple, int]:
    """The link of each linked event (kernel, launch) to the host op or mark it was launched under,
    read from the profiler's raw kineto events, keyed by (device type, id, start) as its events give
    them: torch before 2.13 (the GPU image's 2.11) leaves `linked_correlation_id` off its events, and
    every kernel looked unlinked there. Empty where the events carry it, or the raw ones are not there."""
    events = profiler.events()
    if not events or hasattr(events[0], "linked_correlation_id"):
        return {}
    try:
        results = profiler.profiler.kineto_results
        trace_start = results.trace_start_ns()
        raw = results.events()
    except AttributeError:
        return {}
    # an event's start as torch computes it for its own events: microseconds from the trace's start
    return {(event.device_type(), event.correlation_id(), (event.start_ns() - trace_start) / 1000):
            event.linked_correlation_id() for event in raw if event.linked_correlation_id() > 0}


class DeviceTrace:
    """What the CUDA analyses read of a trace, gathered once: the device's kernels by start, the
    host ops and marks by id (not the launches: those carry a link themselves), and the marks
    kineto drew on the device's timeline as (start, -end, name), sorted. `links`: `kineto_links`,
    for events that do not carry theirs."""

    def __init__(self, events, links: dict[tuple, int] | None = None) -> None:
        self._links = links or {}
        self.kernels = sorted(device_kernels(events), key=lambda event: event.time_range.start)
        self.hosts = {event.id: event for event in events
                      if event.device_type == DeviceType.CPU and not self.linked_id(event)}
        self.marks = sorted((event.time_range.start, -event.time_range.end, event.name) for event in events
                            if event.device_type == DeviceType.CUDA and _is_mark(event.name))

    def linked_id(self, event) -> int:
        """The id of the host op or mark `event` was launched under; 0 for none."""
        linked = getattr(event, "linked_correlation_id", None)
        if linked is None:
            linked = self._links.get((event.device_type, event.id, event.time_range.start), 0)
        return linked

    def host_of(self, kernel):
        """The host op or mark `kernel` was launched under, or None."""
        return self.hosts.get(self.linked_id(kernel))


class InnermostMark:
    """The innermost `vlm.*` mark that kineto drew on the device's timeline around a time, for
    times asked in increasing order (one sweep over `DeviceTrace.marks`; marks nest: a step's
    mark holds its forward's)."""

    def __init__(self, marks: list[tuple[float, float, str]]) -> None:
        self.marks = marks
        self.open: list[tuple[float, str]] = []  # (end, name), innermost last
        self.next = 0

    def edges(self) -> list[float]:
        """Every mark's start and end, sorted."""
        return sorted({time for start, negative_end, _ in self.marks for time in (start, -negative_end)})

    def at(self, time: float) -> str | None:
        """The name of the innermost mark open at `time` (None: none is)."""
        while self.next < len(self.marks) and self.marks[self.next][0] <= time:
            mark_start, negative_end, name = self.marks[self.next]
            while self.open and self.open[-1][0] <= mark_start:
                self.open.pop()
            self.open.append((-negative_end, name))
            self.next += 1
        while self.open and self.open[-1][0] <= time:
            self.open.pop()
        return self.open[-1][1] if self.open else None


def charged_kernels(trace: DeviceTrace) -> tuple[list[tuple[str, str, float]], float]:
    """(region, name, microseconds) per kernel, and the microseconds charged without a host link.

    A kernel's `linked_correlation_id` is the id of the host op or mark it was launched under.
    Unlinked kernels go to the innermost device-side mark around their start."""
    marks = InnermostMark(trace.marks)
    units: list[tuple[str, str, float]] = []
    unlinked = 0.0
    for kernel in trace.kernels:
        start, micros = kernel.time_range.start, kernel.time_range.end - kernel.time_range.start
        host = trace.host_of(kernel)
        mark = marks.at(start)
        if host is not None:
            region = region_of(host)
        else:
            region = mark or UNMARKED
            unlinked += micros
        units.append((region, kernel.name, micros))
    return units, unlinked


def device_gaps(kernels) -> list[tuple[float, float, object, object]]:
    """The stretches between `kernels` (sorted by start) that none covers, in order: (start, end,
    the kernel that had run furthest before it, the kernel after it), in microseconds."""
    gaps = []
    last = None  # the kernel whose end reaches furthest so far
    for kernel in kernels:
        if last is not None and kernel.time_range.start > last.time_range.end:
            gaps.append((last.time_range.end, kernel.time_range.start, last, kernel))
        if last is None or kernel.time_range.end > last.time_range.end:
            last = kernel
    return gaps


def idle_by_region(trace: DeviceTrace) -> dict[str, dict]:
    """Per region: the microseconds the device ran nothing inside its device-side marks (each
    stretch of a gap charged to the innermost mark around it; outside every mark: `unmarked`),
    and the gaps of `WAIT_MIN_MICROS` and more summed by (the kernel before, the host op that
    launched the kernel after): {region: {"idle": us, "waits": {(before, launched_by, after): [us, count]}}}."""
    marks = InnermostMark(trace.marks)
    edges = marks.edges()
    regions: dict[str, dict] = defaultdict(lambda: {"idle": 0.0, "waits": defaultdict(lambda: [0.0, 0])})
    for gap_start, gap_end, before, after in device_gaps(trace.kernels):
        host = trace.host_of(after)
        key = (before.name[:100], host.name[:100] if host is not None else None, after.name[:100])
        # the gap in pieces at the marks' edges inside it, each charged to the mark around it
        inside = edges[bisect.bisect_right(edges, gap_start):bisect.bisect_left(edges, gap_end)]
        for piece_start, piece_end in zip([gap_start, *inside], [*inside, gap_end]):
            totals = regions[marks.at(piece_start) or UNMARKED]
            totals["idle"] += piece_end - piece_start
            if gap_end - gap_start >= WAIT_MIN_MICROS:
                wait = totals["waits"][key]
                wait[0] += piece_end - piece_start
                wait[1] += 1
    return regions


def profile_breakdown(profiler, on_cuda: bool, wall_seconds: float) -> dict:
    """The profiled run's kernel time by region and kind, its largest kernels per region, and how
    busy the device was over `wall_seconds` (see the module docstring)."""
    by_region: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    by_name: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    intervals: list[tuple[float, float]] = []
    events = profiler.events()
    unlinked = 0.0
    idle: dict[str, dict] = {}
    if on_cuda:
        trace = DeviceTrace(events, kineto_links(profiler))
        units, unlinked = charged_kernels(trace)
        intervals = [(kernel.time_range.start, kernel.time_range.end) for kernel in trace.kernels]
        idle = idle_by_region(trace)
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
    for region in sorted(set(by_region) | set(idle), key=lambda name: -sum(by_region[name].values())):
        kinds = by_region[region]
        top = sorted(by_name[region].items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
        regions[region] = {
            "seconds": sum(kinds.values()) / 1e6,
            "kinds": {kind: micros / 1e6 for kind, micros in sorted(kinds.items(), key=lambda item: -item[1])},
            "top": [{"name": name, "seconds": micros / 1e6, "calls": calls} for name, (micros, calls) in top],
        }
        if on_cuda:  # the device's idle time inside the region, and its longest waits (module docstring)
            waits = sorted(idle.get(region, {}).get("waits", {}).items(), key=lambda item: -item[1][0])
            regions[region]["idle_seconds"] = idle.get(region, {}).get("idle", 0.0) / 1e6
            regions[region]["waits"] = [
                {"before": before, "launched_by": launched_by, "after": after, "seconds": micros / 1e6, "count": count}
                for (before, launched_by, after), (micros, count) in waits[:TOP_WAITS]]
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
