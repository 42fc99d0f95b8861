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
reuse instead of trimmed. It is a no-op where the C library is not glibc;
`EngineConfig(tune_cpu_allocator=False)` skips it.

The cost: freed memory is kept even where nothing reuses it. Over a long
batch job the heap fragments (images of every size are decoded and encoded),
and its free part keeps growing: over 10,000 realistic records RSS rose from
1.6 to 2.0 GiB while the memory in use stayed at 240 MiB. So the engine calls
`release_free_memory()` (glibc's `malloc_trim(0)`, which hands every free page
back to the kernel, also inside the heap) every
`EngineConfig.release_host_memory_every_s`: about 50 ms to hand back ~500 MiB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
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


def release_free_memory() -> bool:
    """Return the heap's free pages to the kernel (glibc); True if any memory was released."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library if it is glibc (found once: `find_library` runs `ldconfig`)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    path = ctypes.util.find_library("c")
    return ctypes.CDLL(path) if path is not None else None


def _set_glibc_thresholds() -> bool:
    libc = _glibc()
    if libc is None:
        return False
    # mallopt returns 1 on success, 0 on error
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
