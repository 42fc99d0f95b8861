"""Time spent by one part of a step on the device, without synchronizing it.

On CUDA the host only queues kernels, so a host clock around a call measures
the launches, not the work. `DeviceTimer` records a pair of CUDA events around
each timed call and adds up their elapsed times once the device has passed
them (`seconds` never waits: a pair still in flight is counted on a later
read; after the step's sampling has synchronized, every pair is done). On CPU
the work is synchronous and a host clock measures it.

`host_seconds` is the host clock inside the timed calls on every device: on CUDA,
what launching them took (and any wait inside). A timed call whose device time
is about its host time was bound by its launches: the device waited for the host.

A timer with a `label` also marks its calls for torch.profiler (`record_function`),
so a profile can tell which part of a step launched each kernel
(`vlm_catalog/bench/device_profile.py`); outside a profile the mark costs a few
microseconds.
"""

from __future__ import annotations

import time
from collections import deque

import torch


class DeviceTimer:
    def __init__(self, device: torch.device, label: str | None = None) -> None:
        self.on_cuda = device.type == "cuda"
        self.label = label
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._done_seconds = 0.0
        self._started: torch.cuda.Event | None = None  # CUDA: the running call's start event
        self._host_started = 0.0
        self.host_seconds = 0.0  # the host clock inside the timed calls (module docstring)
        self._mark: torch.profiler.record_function | None = None

    def __enter__(self) -> DeviceTimer:
        if self.label is not None:
            self._mark = torch.profiler.record_function(self.label)
            self._mark.__enter__()
        self._host_started = time.perf_counter()
        if self.on_cuda:
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record()
        return self

    def __exit__(self, *exc_info) -> None:
        if self.on_cuda:
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()
            self._pending.append((self._started, ended))
            self._started = None
        host = time.perf_counter() - self._host_started
        self.host_seconds += host
        if not self.on_cuda:  # the work was synchronous: the host clock is its time
            self._done_seconds += host
        if self._mark is not None:
            self._mark.__exit__(*exc_info)
            self._mark = None

    @property
    def seconds(self) -> float:
        """Total time of the timed calls the device has finished."""
        while self._pending and self._pending[0][1].query():
            started, ended = self._pending.popleft()
            self._done_seconds += started.elapsed_time(ended) / 1e3  # elapsed_time is in ms
        return self._done_seconds
