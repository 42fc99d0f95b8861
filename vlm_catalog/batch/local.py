"""The single-process runner: catalogue items through one engine, a bounded window at a time.

At most `window` requests are in the engine at once; a new record is added
only when one finishes. Records are read and prepared (messages, schema,
prompt tokens, image headers) ahead, in background threads (`ReadAhead`), at
most `read_ahead` records beyond the window, so the engine thread, which
drives the device, only adds them. Memory holds the window's and the
read-ahead's raw image bytes and tokens (and the pixels of the images being
encoded), whatever the dataset's size. Each finished record is handed to
`emit` at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

from vlm_catalog.batch.requests import RequestBuilder, ResultLine, failure_kind_of_error
from vlm_catalog.data.loader import CatalogueItem
from vlm_catalog.engine.llm_engine import EngineRequestError, LLMEngine
from vlm_catalog.engine.sampling_params import SamplingParams
from vlm_catalog.engine.step_faults import FailedStepRetries
from vlm_catalog.preprocess.processor import ProcessedPrompt
from vlm_catalog.read_ahead import ReadAhead

logger = logging.getLogger(__name__)

DEFAULT_READ_AHEAD = 64  # records; a step rarely finishes more, so the refill finds them ready


@dataclass
class PreparedItem:
    """A record ready for `LLMEngine.add_request`, or the failed line of one that cannot run."""

    item: CatalogueItem
    prompt: ProcessedPrompt | None = None
    params: SamplingParams | None = None
    bounded: bool = False  # the answer schema is the token-bounded one
    failure: ResultLine | None = None


@dataclass
class FeedStats:
    """How the records reached the engine: the engine thread's time spent getting records ready
    (waiting for the read-ahead, or preparing them itself with `read_ahead=0`), time the device idles."""

    seconds_waiting_for_records: float = 0.0  # the whole run
    seconds_waiting_before_first_step: float = 0.0  # of which, filling the first window
    records_prepared_on_engine_thread: int = 0  # all with read_ahead=0; else only reruns (bounded schema, a failed step)
    failed_steps: int = 0  # engine steps that raised (their records ran again, by bisection)


class _PrepareInline:
    """`ReadAhead`'s consumer side without threads: each record is prepared when it is taken."""

    def __init__(self, items: Iterable[CatalogueItem], prepare: Callable[[CatalogueItem], PreparedItem]) -> None:
        self._items = iter(items)
        self._prepare = prepare
        self.seconds_waiting = 0.0
        self.num_prepared = 0

    def __enter__(self) -> _PrepareInline:
        return self

    def __exit__(self, *exc_info) -> None:
        pass

    def next(self) -> PreparedItem | None:
        started = time.perf_counter()
        try:
            item = next(self._items, None)
            if item is None:
                return None
            self.num_prepared += 1
            return self._prepare(item)
        finally:
            self.seconds_waiting += time.perf_counter() - started


def run_items(
    engine: LLMEngine,
    builder: RequestBuilder,
    items: Iterable[CatalogueItem],
    emit: Callable[[ResultLine], None],
    window: int = 64,
    between_steps: Callable[[], None] | None = None,
    read_ahead: int = DEFAULT_READ_AHEAD,
    prepare_workers: int = 2,
) -> FeedStats:
    """Run every item; call `emit` with each record's line as soon as it is known.

    An answer cut by the token budget under the plain schema is run once more
    with the bounded one (see `RequestBuilder`); only that second answer is emitted.
    `between_steps` is called after every engine step (the job's stop check: it
    may raise to end the run there). Before every step the window is refilled,
    by at most `read_ahead` records (waiting for the read-ahead if need be), so
    which records share a step does not depend on timing. `read_ahead`: records
    prepared ahead by `prepare_workers` threads (0: each is prepared on this
    thread when its turn comes, and the window is refilled whole).
    """
    stats = FeedStats()
    pending: dict[str, tuple[CatalogueItem, bool]] = {}  # engine request id -> (item, bounded schema)
    prepare = partial(prepare_item, engine, builder)
    records = ReadAhead(items, prepare, read_ahead, prepare_workers) if read_ahead > 0 else _PrepareInline(items, prepare)
    retries: FailedStepRetries[tuple[CatalogueItem, bool]] = FailedStepRetries(engine)

    def emit_confirmed_failures(finished: bool = False) -> None:
        for (item, _), error in retries.confirmed_failures(finished):
            emit(ResultLine.failed(item.id, "engine", f"internal engine error: {error}"))

    with records:
        exhausted, stepped = False, False
        try:
            while True:
                suspects = retries.next_group(idle=not pending)
                for item, bounded in suspects:
                    stats.records_prepared_on_engine_thread += 1
                    failure = _add(engine, prepare(item, bounded=bounded), pending)
                    if failure is not None:
                        emit(failure)
                if not retries.isolating:
                    # at most `read_ahead` records join per step, so the first step waits for that many
                    # preparations, not a whole window's (a step admits far fewer than that anyway)
                    limit = 0 if exhausted else min(window - len(pending), read_ahead or window)
                    for _ in range(limit):
                        prepared = records.next()
                        if prepared is None:
                            exhausted = True
                            break
                        failure = _add(engine, prepared, pending)
                        if failure is not None:
                            emit(failure)
                if not pending:
                    if exhausted and not retries.suspects_left:
                        emit_confirmed_failures(finished=True)
                        return stats
                    if between_steps is not None:  # a stop request is honoured during a run of bad records too
                        between_steps()
                    continue  # every record taken so far failed before reaching the engine
                if not stepped:
                    stats.seconds_waiting_before_first_step = records.seconds_waiting
                    stepped = True
                result = retries.step()
                if result.error is not None:
                    retries.dropped(list(pending.values()))  # every one of them was in the engine, and is dropped
                    pending.clear()
                emit_confirmed_failures()
                for output in result.outputs:
                    if not output.finished:
                        continue
                    item, bounded = pending.pop(output.request_id)
                    line = builder.result(item.id, output, engine.config.max_model_len)
                    if line.failure == "length" and not bounded:
                        stats.records_prepared_on_engine_thread += 1
                        failure = _add(engine, prepare(item, bounded=True), pending)
                        if failure is None:
                            continue
                        line = failure
                    emit(line)
                if between_steps is not None:
                    between_steps()
        finally:
            stats.seconds_waiting_for_records = records.seconds_waiting
            stats.failed_steps = retries.faults.failed_steps
            if isinstance(records, _PrepareInline):
                stats.records_prepared_on_engine_thread += records.num_prepared


def prepare_item(engine: LLMEngine, builder: RequestBuilder, item: CatalogueItem, bounded: bool = False) -> PreparedItem:
    """The item's prompt and sampling parameters, or its failed line (runs in the read-ahead's threads).

    A bug that one record meets here is that record's `engine` failure (logged with its traceback),
    so it cannot stop a long job, nor every resume of it at the same record.
    """
    try:
        return _prepared(engine, builder, item, bounded)
    except Exception as exc:  # noqa: BLE001
        logger.exception("preparing record %s failed", item.id)
        return PreparedItem(item, failure=ResultLine.failed(item.id, "engine", f"internal error: {_described(exc)}"))


def _prepared(engine: LLMEngine, builder: RequestBuilder, item: CatalogueItem, bounded: bool) -> PreparedItem:
    if item.record is None:
        return PreparedItem(item, failure=ResultLine.failed(item.id, item.kind or "record", item.error or "unusable record"))
    try:
        messages = builder.messages(item.record)
    except ValueError as exc:  # PromptError
        return PreparedItem(item, failure=ResultLine.failed(item.id, _kind_of(exc), str(exc)))
    try:
        prompt = engine.processor.process(messages)
    except ValueError as exc:  # PromptError, ImageDecodeError (a bomb too), template errors: as the engine reports them
        return PreparedItem(item, failure=ResultLine.failed(item.id, failure_kind_of_error(str(exc)), str(exc)))
    try:  # the budget also fits what the context leaves after the prompt
        params, bounded = builder.params(item.record, bounded, engine.answer_room(prompt))
    except ValueError as exc:  # GrammarError
        return PreparedItem(item, failure=ResultLine.failed(item.id, "record", str(exc)))
    return PreparedItem(item, prompt, params, bounded)


def _add(engine: LLMEngine, prepared: PreparedItem, pending: dict[str, tuple[CatalogueItem, bool]]) -> ResultLine | None:
    """Queue the prepared record's request; its failed line instead if it cannot run."""
    if prepared.failure is not None:
        return prepared.failure
    item = prepared.item
    request_id = f"batch-{item.index}" + ("-bounded" if prepared.bounded else "")
    try:
        engine.add_request(prepared.prompt, prepared.params, request_id=request_id)
    except EngineRequestError as exc:
        return ResultLine.failed(item.id, failure_kind_of_error(str(exc)), str(exc))
    except Exception as exc:  # noqa: BLE001 - a bug one record meets fails that record (add_request registered nothing)
        logger.exception("adding record %s to the engine failed", item.id)
        return ResultLine.failed(item.id, "engine", f"internal engine error: {_described(exc)}")
    pending[request_id] = (item, prepared.bounded)
    return None


def _described(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def _kind_of(exc: Exception) -> str:
    from vlm_catalog.preprocess.image_decode import ImageDecodeError

    if isinstance(exc, ImageDecodeError):
        return "image"
    return "record"
