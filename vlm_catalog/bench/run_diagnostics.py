"""What a timed run paid for besides its own work: kernel variants, collections, allocations.

On the H100 of 2026-11-28 the first timed engine run of every process spent 1.6-3.3 s
more host time in its prefill forward than a second run of the same records, and a
process that found Triton's cache empty lost 2.1 s of device time there too
(docs/benchmarks.md). Three things a first run can pay for that a second does not,
each counted over the `RunDiagnostics` block:

- `triton_variants`: kernel variants launched for the first time in the process.
  Triton specializes every kernel on its constexprs and on whether its integer
  arguments are 1 or multiples of 16; a variant no earlier call launched is loaded
  from the on-disk cache or compiled, on the launching thread. Counted per kernel,
  with the seconds from Triton's pre-compile hook to its post-compile hook
  (`triton.knobs.runtime.jit_cache_hook` / `jit_post_compile_hook`). A warm-up
  that left none for the timed run shows an empty dict.
- `gc`: Python's collections (per generation, and their seconds), from `gc.callbacks`.
- `cuda_allocator`: the caching allocator's device allocations and frees
  (cudaMalloc, cudaFree) and its retries after an out-of-memory, each of which
  frees the cache and synchronizes the device (`torch.cuda.memory_stats` deltas);
  and the pinned host allocator's new blocks and the seconds spent pinning them
  (`torch.cuda.host_memory_stats`: the engine stages every decoded image in pinned
  memory, on the prefetch threads, and a first run grows that pool).

Hooks are chained to any already installed and put back on exit. Under the Triton
interpreter nothing is compiled, so `triton_variants` stays empty on CPU.
"""

from __future__ import annotations

import gc
import sys
import time
from collections import Counter, defaultdict

import torch

ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams", "num_ooms")
# the pinned host allocator's: blocks it pinned to grow its pool, and the microseconds those calls took
HOST_ALLOCATOR_COUNTERS = ("num_host_alloc", "host_alloc_time.total")


class RunDiagnostics:
    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self.variants: Counter[str] = Counter()
        self.variant_seconds: defaultdict[str, float] = defaultdict(float)
        self._variant_started: dict[tuple, float] = {}
        self.collections: Counter[int] = Counter()
        self.gc_seconds = 0.0
        self._gc_started: float | None = None
        self._allocator_before: dict[str, int] | None = None
        self._allocator_after: dict[str, int] | None = None
        self._runtime = None  # triton.knobs.runtime, where the hooks could be installed
        self._saved_hooks: tuple = ()

    # ------------------------------------------------------------ the block
    def __enter__(self) -> RunDiagnostics:
        self._install_triton_hooks()
        gc.callbacks.append(self._on_gc)
        self._allocator_before = self._allocator_counters()
        return self

    def __exit__(self, *exc_info) -> None:
        self._allocator_after = self._allocator_counters()
        gc.callbacks.remove(self._on_gc)
        self._remove_triton_hooks()

    def summary(self) -> dict:
        """The counts of the block (module doc); `triton_variants` is None where the hooks were not
        available (no triton, or one without `knobs.runtime`), `cuda_allocator` None off CUDA."""
        allocator = None
        if self._allocator_before is not None and self._allocator_after is not None:
            allocator = {name: self._allocator_after[name] - self._allocator_before[name]
                         for name in self._allocator_before}
            if "host_alloc_time.total" in allocator:
                allocator["host_alloc_seconds"] = allocator.pop("host_alloc_time.total") / 1e6
        hooked = self._runtime is not None
        return {
            "triton_variants": ({name: {"count": count, "seconds": round(self.variant_seconds[name], 4)}
                                 for name, count in self.variants.most_common()} if hooked else None),
            "triton_variant_seconds": round(sum(self.variant_seconds.values()), 4) if hooked else None,
            "gc": {"collections": {str(generation): n for generation, n in sorted(self.collections.items())},
                   "seconds": round(self.gc_seconds, 4)},
            "cuda_allocator": allocator,
        }

    # ------------------------------------------------------------ gc
    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            self.gc_seconds += time.perf_counter() - self._gc_started
            self.collections[info.get("generation", -1)] += 1
            self._gc_started = None

    # ------------------------------------------------------------ Triton
    def _install_triton_hooks(self) -> None:
        """Only where triton is already imported: a run that never touched it compiles nothing."""
        triton = sys.modules.get("triton")
        runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
            return
        self._runtime = runtime
        self._saved_hooks = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        before, after = self._saved_hooks

        def cache_hook(*args, **kwargs):
            self._variant_started[self._variant_key(kwargs)] = time.perf_counter()
            return before(*args, **kwargs) if before is not None else None  # a true value skips the compile

        def post_compile_hook(*args, **kwargs):
            key = self._variant_key(kwargs)
            name = key[0]
            self.variants[name] += 1
            started = self._variant_started.pop(key, None)
            if started is not None:
                self.variant_seconds[name] += time.perf_counter() - started
            return after(*args, **kwargs) if after is not None else None

        runtime.jit_cache_hook = cache_hook
        runtime.jit_post_compile_hook = post_compile_hook

    def _remove_triton_hooks(self) -> None:
        if self._runtime is not None:
            self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook = self._saved_hooks

    @staticmethod
    def _variant_key(kwargs: dict) -> tuple:
        """(kernel name, Triton's specialization key as text): the pair the two hooks share."""
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[", 1)[0]
        return name, repr(kwargs.get("key"))

    # ------------------------------------------------------------ the allocator
    def _allocator_counters(self) -> dict[str, int] | None:
        if self.device is None or self.device.type != "cuda":
            return None
        stats = torch.cuda.memory_stats(self.device)
        counters = {name: int(stats.get(name, 0)) for name in ALLOCATOR_COUNTERS}
        try:  # the pinned pool's statistics (torch >= 2.6)
            host = torch.cuda.host_memory_stats()
        except (AttributeError, RuntimeError):
            return counters
        return counters | {name: host.get(name, 0) for name in HOST_ALLOCATOR_COUNTERS}
