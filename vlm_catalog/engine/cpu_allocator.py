"""Keep glibc's malloc from returning and re-faulting the engine's working memory.

A CPU step allocates and frees the same multi-megabyte temporaries over and
over (gathered K/V, attention scores, MoE intermediates). glibc serves large
blocks with `mmap` and gives them back to the kernel when freed, and its
default thresholds move as the process runs; the next step then page-faults
fresh zeroed pages for the same sizes. On the offline benchmark that made
decode attention swing between 12 and 50 ms per call for identical inputs
(`docs/benchmarks.md`).

`keep_freed_memory()` fixes both thresholds once per process: blocks up to
`MMAP_THRESHOLD_BYTES` come from the heap, and freed heap memory is kept for
reuse instead of trimmed. The cost is that the process keeps its peak heap
size, which is what a serving process does anyway (as jemalloc or tcmalloc,
the usual LD_PRELOAD remedy, would). It is a no-op where the C library is not
glibc; `EngineConfig(tune_cpu_allocator=False)` skips it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's largest accepted value on 64-bit systems
TRIM_THRESHOLD_BYTES = 2**31 - 1  # keep freed heap memory (the option is a C int)

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Set the thresholds (once per process); True if glibc accepted them."""
    global _applied
    if _applied is None:
        _applied = _set_glibc_thresholds()
    return _applied


def _set_glibc_thresholds() -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    path = ctypes.util.find_library("c")
    if path is None:
        return False
    libc = ctypes.CDLL(path)
    # mallopt returns 1 on success, 0 on error
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
