"""The CPU allocator setting: applied once per process where glibc is the C library."""

import platform

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


def test_other_c_libraries_are_left_alone(monkeypatch):
    monkeypatch.setattr(cpu_allocator.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert cpu_allocator._set_glibc_thresholds() is False
