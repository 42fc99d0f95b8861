"""Progress of a batch run: a tqdm bar on a terminal, a log line every so often otherwise.

Both show records/s, tokens/s, failures and the time left; `counts` feeds the
summary at the end.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import TextIO

from vlm_catalog.batch.requests import ResultLine


class Progress:
    def __init__(self, total: int, *, terminal: bool | None = None, log_every_s: float = 30.0,
                 stream: TextIO | None = None) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.log_every_s = log_every_s
        self.answered = 0
        self.failures: Counter = Counter()
        self.tokens = 0
        self.started = time.perf_counter()
        self._last_log = self.started
        self._bar = None
        if self.terminal:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="rec", desc="extract", file=self.stream, dynamic_ncols=True)

    def restart(self) -> None:
        """Start the clock now (the model is loaded): rates and ETA count work, not start-up."""
        self.started = self._last_log = time.perf_counter()
        if self._bar is not None:
            self._bar.reset(total=self.total)

    @property
    def done(self) -> int:
        return self.answered + sum(self.failures.values())

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def update(self, line: ResultLine) -> None:
        if line.failure is None:
            self.answered += 1
        else:
            self.failures[line.failure] += 1
        self.tokens += line.num_tokens
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(tok_s=f"{self.tokens / max(self.seconds, 1e-9):.0f}",
                                  failed=sum(self.failures.values()), refresh=False)
        elif time.perf_counter() - self._last_log >= self.log_every_s:
            self._last_log = time.perf_counter()
            print(self.status_line(), file=self.stream, flush=True)

    def status_line(self) -> str:
        seconds = max(self.seconds, 1e-9)
        rate = self.done / seconds
        left = (self.total - self.done) / rate if rate else float("inf")
        eta = "?" if left == float("inf") else _duration(left)
        return (
            f"progress: {self.done}/{self.total} records ({100 * self.done / max(self.total, 1):.1f}%), "
            f"{rate:.2f} records/s, {self.tokens / seconds:.0f} tokens/s, "
            f"{sum(self.failures.values())} failed, ETA {eta}"
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"
