"""A step's sampled tokens on their way to the host (async scheduling).

With `EngineConfig.async_scheduling`, the engine does not wait for a step's
sampled tokens before scheduling the next step: each request that sampled holds
a placeholder token (`Request.append_placeholder`), the next step's decode
inputs read the real tokens from `tokens` on the device, and the host reads them
(`read`) only after it has launched that next step's forward pass. The copy to
the host is queued right after the sampling, into pinned memory, with an event
to wait on, so reading them never waits for the later forward pass.
"""

from __future__ import annotations

import time

import torch

from vlm_catalog.engine.request import Request


class PendingTokens:
    def __init__(self, requests: list[Request], tokens: torch.Tensor) -> None:
        """`tokens` [R] int64: the token sampled for `requests[r]`, on the device."""
        if tokens.shape != (len(requests),):
            raise ValueError(f"{len(requests)} requests but tokens of shape {tuple(tokens.shape)}")
        self.requests = requests
        self.tokens = tokens
        self.rows = {request.request_id: row for row, request in enumerate(requests)}
        self.was_read = False
        self.wait_seconds = 0.0  # the host's wait in `read` for the device to get there
        self._ready: torch.cuda.Event | None = None
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = tokens

    def read(self) -> list[int]:
        """The tokens on the host, in request order (waits for the sampling step only; how long
        is `wait_seconds`)."""
        if self._ready is not None:
            started = time.perf_counter()
            self._ready.synchronize()
            self.wait_seconds = time.perf_counter() - started
        self.was_read = True
        return self._host.tolist()
