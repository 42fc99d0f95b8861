"""A LoadGen SUT that sends each query sample to an OpenAI-compatible server.

Like the reference harness's client: one asyncio event loop in its own
thread runs an `AsyncOpenAI` client; `issue_query` schedules one coroutine
per sample on it and returns at once, so many requests are in flight together
(the server batches them). At most `max_in_flight` are sent at once (default
512, under `vlm-catalog serve`'s admission limit of max_num_seqs 256 + 512
waiting, past which it answers 429); the others wait in the client, and their
wait counts in LoadGen's latency as it would in a real queue. In the Server scenario the request
streams (`stream=True`, usage in the last chunk) and the first non-empty text
chunk is reported as the first token; otherwise one plain request per sample.
A request that fails (HTTP error, timeout, refused) completes its sample with
an empty response and is counted, so LoadGen never waits on it. Once the
server has failed `SERVER_FAILURES_TO_STOP` requests in a row (timeouts,
refused or dropped connections, 5xx, streams cut short; not a 4xx: a 400 is
about one sample's request, a 429 about a full server), the samples
not yet sent fail at once: a hung server ended a run only after every
sample's request had timed out (with 48,289 samples, 512 at a time and an
hour each, about 95 hours).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import mlperf_loadgen as lg
from openai import (
    APIConnectionError,
    APITimeoutError,
    AsyncOpenAI,
    AuthenticationError,
    InternalServerError,
    OpenAIError,
)

from vlm_catalog.bench.loadgen.harness import BenchError
from vlm_catalog.bench.loadgen.qsl import CatalogueQSL
from vlm_catalog.bench.loadgen.requests import Sampling
from vlm_catalog.bench.loadgen.responses import ResponseSink

DEFAULT_TIMEOUT_S = 3600.0
DEFAULT_MAX_IN_FLIGHT = 512
SERVER_FAILURES_TO_STOP = 64  # requests in a row the server failed, after which the rest fail unsent
_CONNECT_TIMEOUT_S = 5.0
_PROBE_TIMEOUT_S = 10.0  # the start-up /models request (the samples' own requests wait up to timeout_s)


class ServerUnreachableError(BenchError):
    """The server at --server-url does not answer (or not as asked); the message names the URL."""


class IncompleteStreamError(Exception):
    """A streamed answer whose connection closed before the server said it finished."""


# what a broken or hung server does (not a 4xx: a 400 is about one sample's request, a 429 a full server)
SERVER_FAILURES = (APIConnectionError, InternalServerError, IncompleteStreamError)  # timeouts are connection errors


def openai_base_url(server_url: str) -> str:
    """`http://host:port` or `http://host:port/v1` -> the client's base URL (ending in /v1)."""
    url = server_url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--server-url must start with http:// or https://, got {server_url!r}")
    return url if url.endswith("/v1") else url + "/v1"


class HttpSUT:
    """Use as a context manager: starts the client's event loop and constructs the LoadGen SUT."""

    def __init__(
        self,
        server_url: str,
        model: str | None,
        qsl: CatalogueQSL,
        sampling: Sampling,
        max_tokens: int,
        sink: ResponseSink,
        stream: bool,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        api_key: str | None = None,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"--max-in-flight must be at least 1, got {max_in_flight}")
        if not timeout_s > 0 or timeout_s == float("inf"):
            raise ValueError(f"--request-timeout must be a positive number of seconds, got {timeout_s}")
        self.base_url = openai_base_url(server_url)
        self.max_in_flight = max_in_flight
        self.model = model
        self.qsl = qsl
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.sink = sink
        self.stream = stream
        self.timeout_s = timeout_s
        self._api_key = api_key
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="bench-http", daemon=True)
        self.client: AsyncOpenAI | None = None
        self._slots: asyncio.Semaphore | None = None
        self._server_failures_in_a_row = 0  # event loop only
        self.stopped_sending: str | None = None  # why the samples not yet sent fail at once
        self.handle = None

    def __enter__(self) -> HttpSUT:
        self._thread.start()
        try:
            self._call(self._open())
        except BaseException:
            self._close()
            raise
        self.handle = lg.ConstructSUT(self.issue_queries, self.flush_queries)
        return self

    def __exit__(self, *exc_info) -> None:
        if self.handle is not None:
            lg.DestroySUT(self.handle)
            self.handle = None
        self._close()

    def _close(self) -> None:
        if self.client is not None:
            self._call(self.client.close())
            self.client = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()

    def _call(self, coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    async def _open(self) -> None:
        """Create the client and check the server answers (and which model it serves)."""
        self._slots = asyncio.Semaphore(self.max_in_flight)
        self.client = AsyncOpenAI(
            base_url=self.base_url,
            api_key=self._api_key or "not-needed",
            timeout=httpx.Timeout(self.timeout_s, connect=_CONNECT_TIMEOUT_S),
            max_retries=0,
        )
        served = await self._served_models()
        if not served:
            raise ServerUnreachableError(f"{self.base_url}/models lists no model")
        if self.model is None:
            self.model = served[0]
        elif self.model not in served:  # else every request would fail with a 404, and the run look fine
            raise ServerUnreachableError(
                f"--server-model {self.model!r}: {self.base_url} serves {', '.join(map(repr, served))}"
            )

    async def _served_models(self) -> list[str]:
        """The ids at /v1/models, asked with a short timeout (a stalled server fails the start in seconds)."""
        try:
            models = await self.client.with_options(timeout=_PROBE_TIMEOUT_S).models.list()
            return [str(model.id) for model in models.data]
        except AuthenticationError:
            raise ServerUnreachableError(
                f"{self.base_url} wants an API key" + (" and refused the one given" if self._api_key else "")
                + ": pass --api-key or set VLM_CATALOG_API_KEY"
            ) from None
        except APITimeoutError:
            raise ServerUnreachableError(
                f"{self.base_url} did not answer /models within {_PROBE_TIMEOUT_S:.0f} s"
            ) from None
        except OpenAIError as exc:
            raise ServerUnreachableError(f"no OpenAI-compatible server at {self.base_url}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - an answer the client cannot read (HTML, another API)
            raise ServerUnreachableError(
                f"{self.base_url} does not answer like an OpenAI-compatible server: /models gave something "
                f"the client cannot read ({type(exc).__name__}: {exc})"
            ) from None

    # ------------------------------------------------------- LoadGen thread
    def issue_queries(self, query_samples: list) -> None:
        for sample in query_samples:
            self.sink.issued(sample.id)
            asyncio.run_coroutine_threadsafe(self._query(sample.id, sample.index), self.loop)

    def flush_queries(self) -> None:
        """Nothing is held back: every sample's request is already on its way."""

    # ----------------------------------------------------------- event loop
    async def _query(self, response_id: int, index: int) -> None:
        sample = self.qsl[index]
        if sample.request is None:
            self.sink.fail(response_id, f"sample {index}: {sample.error}")
            return
        arguments = sample.request.openai_arguments(self.sampling, self.max_tokens, self.model)
        try:
            async with self._slots:
                if self.stopped_sending is not None:
                    self.sink.fail(response_id, f"sample {index}: not sent: {self.stopped_sending}")
                    return
                if self.stream:
                    text, tokens = await self._streamed(response_id, arguments)
                else:
                    text, tokens = await self._whole(arguments)
        except Exception as exc:  # noqa: BLE001 - one failed request must not hang LoadGen
            # counted, with every reason kept (not one log line per sample: a run has 48k)
            reason = f"{type(exc).__name__}: {exc}"
            self.sink.fail(response_id, f"sample {index}: {reason}")
            if isinstance(exc, SERVER_FAILURES):
                self._server_failures_in_a_row += 1
                if self._server_failures_in_a_row >= SERVER_FAILURES_TO_STOP and self.stopped_sending is None:
                    self.stopped_sending = (f"the server failed {SERVER_FAILURES_TO_STOP} requests in a row, "
                                            f"the last with {reason.splitlines()[0]}")
            return
        self._server_failures_in_a_row = 0
        self.sink.complete(response_id, text, tokens)

    async def _whole(self, arguments: dict[str, Any]) -> tuple[str, int]:
        response = await self.client.chat.completions.create(**arguments)
        text = response.choices[0].message.content or ""
        tokens = response.usage.completion_tokens if response.usage is not None else 0
        return text, int(tokens)

    async def _streamed(self, response_id: int, arguments: dict[str, Any]) -> tuple[str, int]:
        stream = await self.client.chat.completions.create(
            **arguments, stream=True, stream_options={"include_usage": True}
        )
        pieces: list[str] = []
        tokens = 0
        finished = False
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = int(chunk.usage.completion_tokens)
            if not chunk.choices:
                continue
            finished = finished or chunk.choices[0].finish_reason is not None
            text = chunk.choices[0].delta.content
            if text:
                if not pieces:
                    self.sink.first_token(response_id, text)
                pieces.append(text)
        if not finished:  # the connection closed mid-answer: a cut answer is no answer
            raise IncompleteStreamError(f"the stream ended before a finish_reason, after {len(pieces)} pieces")
        return "".join(pieces), tokens
