"""Items read and prepared ahead of their consumer, in background threads, in their order.

An engine thread is the device's only driver: whatever it does between steps
leaves the GPU idle. Reading a record, building its messages and schema and
preparing its prompt (chat template, tokens, image headers) took 3.2-3.6 ms
per record on the batch job's engine thread on the 2-core CPU machine, 5-7%
of a run's wall time (`scripts/bench_batch_feed.py`). With `ReadAhead`, a
reader thread pulls the items and a small pool prepares them, at most
`depth` ahead of the consumer, which takes them already prepared, in the
order the items came. The batch job (`batch/local.py`) and `LLM` (`llm.py`)
feed their engines this way.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

Item = TypeVar("Item")
Prepared = TypeVar("Prepared")

_END = object()  # the reader's last entry: every item was read


class _ReadFailed:
    """The reader's last entry when iterating the items raised: re-raised where that item would be."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class ReadAhead(Generic[Item, Prepared]):
    """`prepare(item)` for each item, computed ahead in `workers` threads; `next()` returns them in item order.

    At most `depth` items are read and not yet taken, so memory holds at most
    `depth` prepared items beyond what the consumer holds. An exception raised
    by `prepare` or by the items' iterator is raised by `next()` at that item's
    place (the items before it are returned first). Use as a context manager,
    or call `close()`: it stops the reader and drops what was prepared and not
    taken.
    """

    def __init__(
        self,
        items: Iterable[Item],
        prepare: Callable[[Item], Prepared],
        depth: int,
        workers: int = 2,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self._items = iter(items)
        self._prepare = prepare
        self._slots = threading.Semaphore(depth)  # one per item read and not yet taken
        self._entries: queue.Queue = queue.Queue()  # Futures in item order, then _END or a _ReadFailed
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="read-ahead-prepare")
        self._closed = threading.Event()
        self._finished = False
        self.seconds_waiting = 0.0  # the consumer's time blocked in next(): items not prepared in time
        self._reader = threading.Thread(target=self._read, name="read-ahead-reader", daemon=True)
        self._reader.start()

    def __enter__(self) -> ReadAhead[Item, Prepared]:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ----------------------------------------------------------- reader thread
    def _read(self) -> None:
        try:
            while True:
                self._slots.acquire()  # before reading: an item is read only when there is room for it
                if self._closed.is_set():
                    return
                item = next(self._items, _END)
                if item is _END:
                    self._entries.put(_END)
                    return
                self._entries.put(self._pool.submit(self._prepare, item))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            if not self._closed.is_set():
                self._entries.put(_ReadFailed(exc))

    # -------------------------------------------------------------- consumer
    def next(self) -> Prepared | None:
        """The next prepared item (waiting for it if need be); None once every item was returned."""
        if self._finished:
            return None
        started = time.perf_counter()
        entry = self._entries.get()
        try:
            if entry is _END:
                self._finished = True
                return None
            if isinstance(entry, _ReadFailed):
                self._finished = True
                raise entry.error
            future: Future = entry
            return future.result()
        finally:
            self.seconds_waiting += time.perf_counter() - started
            if not self._finished:
                self._slots.release()

    def close(self) -> None:
        """Stop reading; wait for the preparations under way (not the queued ones, which are dropped)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._slots.release()  # a reader waiting for a slot wakes, sees the close and ends
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._reader.join(timeout=1.0)  # it may be inside a long read; it is a daemon and ends after it
