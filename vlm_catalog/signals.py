"""Stop a long run at a safe point on SIGINT (Ctrl-C) or SIGTERM.

The handler only records the signal; the run looks at `requested` (or calls
`check()`) where stopping is safe: between training steps, between engine
steps. Raising KeyboardInterrupt from the handler itself could land at any
bytecode, also between a library's lock acquire and its `try` (logging,
futures): the lock then stays held, a worker thread waits on it for ever and
the exit hangs joining that worker (seen in the batch job under load).

SIGINT gets its handler explicitly: a process started in the background by a
non-interactive shell inherits SIGINT ignored, and Python then installs no
KeyboardInterrupt handler of its own, so Ctrl-C (or `kill -INT`) would be
ignored.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def handling(signals, handler) -> Iterator[None]:
    """`handler` for each of `signals` while active, the previous handlers put back after.
    Outside the main thread, where Python installs no handlers, signals stay as they are."""
    previous = {}
    for signum in signals:
        try:
            previous[signum] = signal.signal(signum, handler)
        except ValueError:  # not the main thread
            pass
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


class StopRequest:
    """While installed (`with StopRequest() as stop:`), remembers SIGINT/SIGTERM in `requested`.

    `second_signal_interrupts`: a second signal raises KeyboardInterrupt at once, for a
    run stuck where it never checks.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, second_signal_interrupts: bool = False) -> None:
        self.second_signal_interrupts = second_signal_interrupts
        self.requested: str | None = None  # the name of the last signal received
        self._installed = contextlib.ExitStack()

    def __enter__(self) -> StopRequest:
        self._installed.enter_context(handling(self.SIGNALS, self._handle))
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._installed.close()

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.requested is not None and self.second_signal_interrupts:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def check(self) -> None:
        """Raise KeyboardInterrupt if a signal asked the run to stop."""
        if self.requested is not None:
            raise KeyboardInterrupt


def signals_raise_keyboard_interrupt():
    """While active, SIGTERM as well as SIGINT raises KeyboardInterrupt where the main thread is
    (Python's own Ctrl-C), SIGINT also where the process inherited it ignored. For a run that may be
    cut anywhere and says so (a benchmark, whose logs are then incomplete anyway); a run that must
    stop at a safe point uses `StopRequest`."""
    return handling(StopRequest.SIGNALS, signal.default_int_handler)
