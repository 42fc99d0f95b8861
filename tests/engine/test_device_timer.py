"""DeviceTimer: host clock on CPU; on CUDA, event pairs counted once the device passed them
(fake events stand in for CUDA's here: the bookkeeping is what is tested)."""

import time

import pytest
import torch

from tests.engine.conftest import conversation
from vlm_catalog import LLM, SamplingParams
from vlm_catalog.engine.device_timer import DeviceTimer


def test_on_cpu_the_host_clock_measures_the_timed_calls():
    timer = DeviceTimer(torch.device("cpu"))
    assert timer.seconds == 0.0
    for _ in range(2):
        with timer:
            time.sleep(0.02)
    assert 0.04 <= timer.seconds < 1.0
    assert timer.host_seconds == pytest.approx(timer.seconds, rel=0.2)  # on CPU both are the host clock


class FakeEvent:
    clock_ms = 0.0
    instances: list["FakeEvent"] = []

    def __init__(self, enable_timing: bool) -> None:
        assert enable_timing
        self.done = False
        self.at_ms = None
        FakeEvent.instances.append(self)

    def record(self) -> None:
        self.at_ms = FakeEvent.clock_ms

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.done and end.done, "elapsed_time on an event the device has not reached"
        return end.at_ms - self.at_ms


def test_on_cuda_a_pair_counts_once_the_device_has_passed_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.instances.clear()
    timer = DeviceTimer(torch.device("cuda"))
    for duration_ms in (30.0, 50.0):
        with timer:
            FakeEvent.clock_ms += duration_ms
    first_start, first_end, second_start, second_end = FakeEvent.instances
    assert timer.seconds == 0.0  # nothing finished on the device yet; reading never waits
    first_start.done = first_end.done = True
    assert timer.seconds == pytest.approx(0.030)
    second_start.done = second_end.done = True
    assert timer.seconds == pytest.approx(0.080)
    assert timer.seconds == pytest.approx(0.080)  # each pair counted once
    assert 0.0 < timer.host_seconds < 0.030  # the host's launches took microseconds, not the device's 80 ms


def test_on_cuda_the_host_clock_counts_the_launches_before_the_device_finishes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer = DeviceTimer(torch.device("cuda"))
    with timer:
        time.sleep(0.02)  # a slow launch (or a wait inside the call)
    assert timer.seconds == 0.0 and timer.host_seconds >= 0.02  # known at once, without the device


def test_the_engine_reports_the_vision_towers_time(engine_checkpoint):
    llm = LLM(engine_checkpoint)
    llm.chat([conversation(0, images=0)], SamplingParams(max_tokens=2))
    assert llm.engine.stats.seconds_in_vision_encoder == 0.0  # no image: the tower never ran
    llm.chat([conversation(1, images=2)], SamplingParams(max_tokens=2))
    stats = llm.engine.stats
    assert 0.0 < stats.seconds_in_vision_encoder < stats.seconds_in_prefill_steps
    llm.engine.close()


def test_the_engine_splits_its_steps_device_time(engine_checkpoint):
    """Vision, the text forward of prefill and of decode steps, and whole steps: on CPU the host
    clock, so the parts nest inside the steps and the steps inside the step loop's time."""
    llm = LLM(engine_checkpoint)
    llm.chat([conversation(2, images=1)], SamplingParams(max_tokens=3, ignore_eos=True))
    stats = llm.engine.stats
    assert stats.seconds_device_forward_prefill_steps > 0.0  # the prompt's step
    assert stats.seconds_device_forward_decode_steps > 0.0  # the two steps after it
    assert (stats.num_prefill_steps, stats.num_decode_steps) == (1, 2)
    assert 0.0 < stats.seconds_host_forward_prefill_steps <= stats.seconds_in_prefill_steps
    assert 0.0 < stats.seconds_host_forward_decode_steps <= stats.seconds_in_decode_steps
    parts = (stats.seconds_in_vision_encoder + stats.seconds_device_forward_prefill_steps
             + stats.seconds_device_forward_decode_steps)
    assert parts <= stats.seconds_device_in_steps <= stats.seconds_in_prefill_steps + stats.seconds_in_decode_steps
    runner = llm.engine.runner
    runner.reset_counters()
    assert runner.step_timer.seconds == 0.0
    assert all(timer.seconds == 0.0 == timer.host_seconds for timer in runner.forward_timers.values())
    llm.engine.close()
