"""Decode the images of the requests about to run while the device works on the current step.

An image's pixels are decoded (JPEG decode, smart resize, patches) on the host
when a prefill chunk first touches it. At the benchmark's image sizes that is
~60 ms of CPU per image, and a step that admits seven records would wait for
it with the GPU idle. The engine instead names, after each step is scheduled,
the images the next steps are likely to need (`Scheduler.upcoming_images`:
running requests' images not yet computed, then the waiting queue in policy
order), and the prefetcher decodes them in background threads while the
forward pass runs.

What is held is bounded in bytes: the held images are always the longest
prefix of the upcoming order whose pixels fit in `max_bytes` (estimated from
the grid the header gave). An image that falls out of that prefix (its
request was aborted, or newer requests come first) is dropped, and one not
held is decoded when it is needed, as without a prefetcher.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from vlm_catalog.preprocess.image import ImageProbe

# what a decode gives: the uint8 pixel rows [patches, patch_dim] (ModelRunner._staged), or the error message
Decoded = torch.Tensor | str


@dataclass
class _Held:
    future: Future
    num_bytes: int


class ImagePrefetcher:
    """Background image decodes for the upcoming steps, bounded by `max_bytes` (0: off).

    `decode(probe)` returns pixel rows or an error message and must not raise;
    `bytes_of(probe)` estimates what its result holds. `workers` threads run
    prefetches; images needed now that were not prefetched are decoded by
    another `workers` threads, so they never queue behind prefetches.
    """

    def __init__(
        self,
        decode: Callable[[ImageProbe], Decoded],
        bytes_of: Callable[[ImageProbe], int],
        max_bytes: int,
        workers: int | None = None,
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0: no prefetching), got {max_bytes}")
        self.decode = decode
        self.bytes_of = bytes_of
        self.max_bytes = max_bytes
        self._prefetch_pool = ThreadPoolExecutor(workers, thread_name_prefix="image-prefetch")
        self._now_pool = ThreadPoolExecutor(workers, thread_name_prefix="image-decode")
        self._held: dict[str, _Held] = {}  # content hash -> decode, in upcoming order
        self.held_bytes = 0
        self.num_prefetch_hits = 0  # images taken from a prefetch
        self.num_decoded_on_demand = 0  # images decoded when needed (not prefetched)
        self.num_dropped = 0  # prefetches no longer wanted
        self.seconds_waiting = 0.0  # time `take` waited for pixels

    def reset_counters(self) -> None:
        self.num_prefetch_hits = self.num_decoded_on_demand = self.num_dropped = 0
        self.seconds_waiting = 0.0

    def close(self) -> None:
        for pool in (self._prefetch_pool, self._now_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        self._held.clear()
        self.held_bytes = 0

    @property
    def held_hashes(self) -> list[str]:
        return list(self._held)

    def prefetch(self, upcoming: Iterable[ImageProbe]) -> None:
        """Hold decodes of the longest prefix of `upcoming` (soonest first) that fits `max_bytes`.

        Held images outside that prefix are dropped (cancelled if not started).
        Repeated images count once. Reads `upcoming` only as far as the budget reaches.
        """
        if self.max_bytes == 0:
            return
        keep: dict[str, _Held] = {}
        total = 0
        for probe in upcoming:
            if probe.content_hash in keep:
                continue
            held = self._held.get(probe.content_hash)
            num_bytes = held.num_bytes if held is not None else self.bytes_of(probe)
            if total + num_bytes > self.max_bytes:
                break
            if held is None:
                held = _Held(self._prefetch_pool.submit(self.decode, probe), num_bytes)
            keep[probe.content_hash] = held
            total += num_bytes
        for content_hash, held in self._held.items():
            if content_hash not in keep:
                held.future.cancel()
                self.num_dropped += 1
        self._held = keep
        self.held_bytes = total

    def take(self, images: list[ImageProbe]) -> list[Decoded]:
        """The decoded pixels (or error message) of each image, in order: a held prefetch's
        result (it is no longer held), or a decode now, all not-held images in parallel."""
        started = time.perf_counter()
        pending: list[Future] = []
        for probe in images:
            held = self._held.pop(probe.content_hash, None)
            if held is not None:
                self.held_bytes -= held.num_bytes
                self.num_prefetch_hits += 1
                pending.append(held.future)
            else:
                self.num_decoded_on_demand += 1
                pending.append(self._now_pool.submit(self.decode, probe))
        results = [future.result() for future in pending]
        self.seconds_waiting += time.perf_counter() - started
        return results
