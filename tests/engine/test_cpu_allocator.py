"""The CPU allocator setting: applied once per process where glibc is the C library."""

import platform
import subprocess
import sys

import pytest

from vlm_catalog.engine import cpu_allocator


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_accepts_the_thresholds(monkeypatch):
    monkeypatch.setattr(cpu_allocator, "_applied", None)
    assert cpu_allocator.keep_freed_memory() is True


def test_applied_once_per_process(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_allocator, "_applied", None)
    monkeypatch.setattr(cpu_allocator, "_set_glibc_thresholds", lambda: calls.append(1) or True)
    assert cpu_allocator.keep_freed_memory() and cpu_allocator.keep_freed_memory()
    assert calls == [1]


@pytest.fixture
def musl(monkeypatch):
    """A C library that is not glibc (the cached lookup of the C library forgotten around it)."""
    cpu_allocator._glibc.cache_clear()
    monkeypatch.setattr(cpu_allocator.platform, "libc_ver", lambda: ("musl", "1.2"))
    yield
    cpu_allocator._glibc.cache_clear()


def test_other_c_libraries_are_left_alone(musl):
    assert cpu_allocator._set_glibc_thresholds() is False


RELEASE_PROBE = """
import torch
from vlm_catalog.engine import cpu_allocator

def rss_mib():
    with open("/proc/self/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) / 1024

assert cpu_allocator._set_glibc_thresholds()
baseline = rss_mib()
blocks = [torch.ones(2**20) for _ in range(64)]  # 64 blocks of 4 MiB, under the mmap threshold: heap
grown = rss_mib()
assert grown > baseline + 200, (baseline, grown)
del blocks
kept = rss_mib()
assert kept > baseline + 200, ("freed blocks were already returned: the thresholds did not apply", baseline, kept)
assert cpu_allocator.release_free_memory() is True
released = rss_mib()
assert released < kept - 200, (kept, released)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_release_gives_the_kept_free_heap_back():
    """With the thresholds set, freed heap blocks stay resident; releasing hands them back.

    In a fresh process: in the test process, the heap that earlier tests left (other threads'
    arenas, memory freed while it is measured) made RSS move for other reasons, in some orders."""
    probe = subprocess.run([sys.executable, "-c", RELEASE_PROBE], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]


def test_no_release_where_the_c_library_is_not_glibc(musl):
    assert cpu_allocator.release_free_memory() is False


def test_the_engine_releases_on_its_interval(engine_checkpoint, monkeypatch):
    from vlm_catalog.engine import llm_engine
    from vlm_catalog.engine.config import EngineConfigError
    from vlm_catalog.engine.sampling_params import SamplingParams

    calls = []
    monkeypatch.setattr(llm_engine, "release_free_memory", lambda: calls.append(1) or True)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = [{"role": "user", "content": [{"type": "text", "text": "a lamp"}]}]
    for interval, expected in ((1e-9, "every step"), (0.0, "never"), (3600.0, "not within the hour")):
        engine = llm_engine.LLMEngine(model=engine_checkpoint, release_host_memory_every_s=interval)
        engine.add_request(prompt, params)
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        assert len(calls) == (steps if expected == "every step" else 0), expected
        assert engine.stats.num_host_memory_releases == len(calls)
        calls.clear()
        engine.close()
    with pytest.raises(EngineConfigError, match="release_host_memory_every_s must be >= 0"):
        llm_engine.LLMEngine(model=engine_checkpoint, release_host_memory_every_s=-1)
