"""The single-process runner: catalogue items through one engine, a bounded window at a time.

At most `window` requests are in the engine at once; the next record is read
only when one finishes. So memory holds the window's raw image bytes and
tokens (and the pixels of the images being encoded), whatever the dataset's
size. Each finished record is handed to `emit` at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from vlm_catalog.batch.requests import RequestBuilder, ResultLine, failure_kind_of_error
from vlm_catalog.data.loader import CatalogueItem
from vlm_catalog.engine.llm_engine import EngineRequestError, LLMEngine


def run_items(
    engine: LLMEngine,
    builder: RequestBuilder,
    items: Iterable[CatalogueItem],
    emit: Callable[[ResultLine], None],
    window: int = 64,
    between_steps: Callable[[], None] | None = None,
) -> None:
    """Run every item; call `emit` with each record's line as soon as it is known.

    An answer cut by the token budget under the plain schema is run once more
    with the bounded one (see `RequestBuilder`); only that second answer is emitted.
    `between_steps` is called after every engine step (the job's stop check: it
    may raise to end the run there).
    """
    pending: dict[str, tuple[CatalogueItem, bool]] = {}  # engine request id -> (item, bounded schema)
    items = iter(items)
    exhausted = False
    while True:
        while not exhausted and len(pending) < window:
            item = next(items, None)
            if item is None:
                exhausted = True
                break
            failure = _submit(engine, builder, item, pending)
            if failure is not None:
                emit(failure)
        if not pending:
            if exhausted:
                return
            continue
        for output in engine.step():
            if not output.finished:
                continue
            item, bounded = pending.pop(output.request_id)
            line = builder.result(item.id, output)
            if line.failure == "length" and not bounded:
                failure = _submit(engine, builder, item, pending, bounded=True)
                if failure is None:
                    continue
                line = failure
            emit(line)
        if between_steps is not None:
            between_steps()


def _submit(
    engine: LLMEngine, builder: RequestBuilder, item: CatalogueItem,
    pending: dict[str, tuple[CatalogueItem, bool]], bounded: bool = False,
) -> ResultLine | None:
    """Queue the item's request; the failed line instead if the record cannot run."""
    if item.record is None:
        return ResultLine.failed(item.id, item.kind or "record", item.error or "unusable record")
    try:
        messages, params, bounded = builder.build(item.record, bounded=bounded)
    except ValueError as exc:  # PromptError, ImageDecodeError (a decompression bomb too), GrammarError
        return ResultLine.failed(item.id, _kind_of(exc), str(exc))
    request_id = f"batch-{item.index}" + ("-bounded" if bounded else "")
    try:
        engine.add_request(messages, params, request_id=request_id)
    except EngineRequestError as exc:
        return ResultLine.failed(item.id, failure_kind_of_error(str(exc)), str(exc))
    pending[request_id] = (item, bounded)
    return None


def _kind_of(exc: Exception) -> str:
    from vlm_catalog.preprocess.image_decode import ImageDecodeError

    if isinstance(exc, ImageDecodeError):
        return "image"
    return "record"
