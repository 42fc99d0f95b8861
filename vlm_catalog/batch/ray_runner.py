"""The batch job on a Ray cluster, with Ray Data (the optional `[distributed]` extra).

The pipeline:

    from_items(groups of pending record indices)          driver: ids only, no data
      .flat_map(read_records)      Ray tasks: read rows, validate, check image headers
      .map_batches(ExtractReplica, concurrency=replicas)   one engine per replica
                                   (num_gpus=1 each on GPU clusters, else num_cpus=1)
      .iter_rows()                 driver: each result line -> the results file

The driver alone writes the results file, through the same `emit` as the
single-process runner, so the lock, resume and exactly-once guarantee are the
same: ids already written are never queued, and a line that comes twice (a
Ray task retried after its first result arrived) is written once. Records
travel as raw image bytes plus text; a replica runs each batch through the
engine with the same `RequestBuilder` as the local runner, so answers are
equal to a single-process run.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import re
import signal
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vlm_catalog.batch.requests import ResultLine

INDICES_PER_READ_TASK = 32
READER_CPUS = 1  # left free beside the replicas' CPUs for the read tasks, which take one each


class RayRunError(RuntimeError):
    """The run cannot go on on Ray: one line for the job's error (a cluster without what the run
    needs, a replica whose model does not load, a task that failed)."""


def run_on_ray(settings, indices: list[int], emit: Callable[[ResultLine], None], on_ready: Callable[[], None]) -> None:
    import ray
    from ray.exceptions import RayError

    started_here = not ray.is_initialized()
    if started_here:
        address = settings.ray_address or None  # None: the running cluster if any, else a local one
        try:
            with _signal_handlers_kept():
                ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False,
                         include_dashboard=False)
        except (ValueError, ConnectionError, RuntimeError) as exc:  # ray:// without ray[client], no cluster there
            raise RayRunError(f"cannot join the Ray cluster {address or '(local)'}: {_first_line(exc)}") from None
    try:
        if not indices:
            return
        rows = iter(build_pipeline(settings, indices).iter_rows())
        first = next(rows, None)  # the replicas load the model first: one that does not load raises here
        on_ready()  # only now is the results file emptied (--overwrite) and its job written
        for row in itertools.chain([first] if first is not None else [], rows):
            emit(ResultLine(**json.loads(row["line"])))
    except RayError as exc:
        raise RayRunError(f"a Ray task failed: {_root_cause(exc)}; the lines written so far are kept, "
                          "and the same command resumes") from None
    finally:
        if started_here:
            ray.shutdown()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _root_cause(exc: BaseException) -> str:
    """The error under Ray's wrappers, in one line: a task's own exception (`cause`), or the last
    "SomethingError: ..." line of a dead actor's report (a replica whose model did not load)."""
    cause = getattr(exc, "cause", None)
    # Ray Data wraps a function's error in a UserCodeException whose own message says nothing
    # ("UDF failed to process a data block"): the error itself is in the report's lines
    if isinstance(cause, BaseException) and cause is not exc and type(cause).__name__ != "UserCodeException":
        return _root_cause(cause) if hasattr(cause, "cause") else f"{type(cause).__name__}: {_first_line(cause)}"
    errors = [line.strip() for line in str(exc).splitlines() if re.match(r"^\s*[\w.]*(Error|Exception): ", line)]
    return errors[-1] if errors else _first_line(exc)


@contextlib.contextmanager
def _signal_handlers_kept():
    """Put back the SIGINT/SIGTERM handlers after `ray.init`, which installs its own SIGTERM handler
    (exit at once, status 15): the job's StopRequest keeps them, so a stopped run ends between
    lines with status 130 and every finished line on disk."""
    kept = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in kept.items():
            if handler is not None and signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)


def build_pipeline(settings, indices: list[int]):
    import ray

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the job's own progress bar counts records
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    groups = [
        {"indices": indices[start:start + INDICES_PER_READ_TASK]}
        for start in range(0, len(indices), INDICES_PER_READ_TASK)
    ]
    engine_settings = _engine_settings(settings)  # its paths absolute: the workers' cwd differs
    source = {"dataset": engine_settings["dataset"], "split": settings.split}
    on_gpu = settings.device.startswith("cuda")
    replicas = replica_count(settings.replicas, on_gpu, ray.cluster_resources(),
                             sum(1 for node in ray.nodes() if node.get("Alive")))
    return (
        ray.data.from_items(groups)
        .flat_map(functools.partial(read_records, **source))
        .map_batches(
            ExtractReplica,
            fn_constructor_kwargs={"engine_settings": engine_settings},
            batch_size=settings.window,
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=replicas),
            num_gpus=1 if on_gpu else 0,
            num_cpus=1,
        )
    )


def replica_count(asked: int | None, on_gpu: bool, resources: dict[str, float], alive_nodes: int) -> int:
    """How many engine replicas the cluster can run beside the readers, or `RayRunError`. Each
    replica takes a CPU (and a GPU with `--device cuda`), and `READER_CPUS` stay free for the read
    tasks: with every CPU taken by a replica, the run waited for ever, silently (a 1-CPU machine
    by default), as it did for a GPU on a cluster with none. `--replicas` (`asked`) is taken as
    given, for a cluster that grows as the job asks (autoscaling)."""
    if asked is not None:  # as given: an autoscaling cluster may start with no CPU or GPU to show
        return asked
    cpus, gpus = int(resources.get("CPU", 0)), int(resources.get("GPU", 0))
    if on_gpu and gpus < 1:
        raise RayRunError("--device cuda, but the Ray cluster has no GPU; add GPU nodes or run with --device cpu")
    if cpus < 1 + READER_CPUS:
        raise RayRunError(f"the Ray cluster has {cpus} CPU(s); a run needs at least {1 + READER_CPUS} "
                          f"(one per replica, {READER_CPUS} for reading the dataset)")
    room = min(cpus - READER_CPUS, gpus) if on_gpu else cpus - READER_CPUS
    return max(1, min(room, gpus if on_gpu else max(1, alive_nodes)))


def _engine_settings(settings) -> dict[str, Any]:
    values = asdict(settings)
    values.update(dataset=str(Path(settings.dataset).resolve()), out=str(Path(settings.out).resolve()),
                  model=str(Path(settings.model).resolve()), shard=str(settings.shard))
    return values


@functools.lru_cache(maxsize=4)
def _catalogue(dataset: str, split: str | None):
    from vlm_catalog.data.loader import load_catalogue

    return load_catalogue(dataset, split=split)


def read_records(group: dict[str, Any], dataset: str, split: str | None) -> list[dict[str, Any]]:
    """Rows for a group of indices: the record's fields, or its error (Ray task)."""
    rows = []
    for item in _catalogue(dataset, split).items(group["indices"]):
        record = item.record
        rows.append({
            "index": item.index,
            "title": record.title if record else "",
            "description": record.description if record else "",
            "image": record.image if record else b"",
            "candidates": json.dumps(record.candidate_categories if record else []),
            "error": item.error or "",
            "kind": item.kind or "",
        })
    return rows


class ExtractReplica:
    """One engine replica (a Ray actor): runs batches of records, returns their result lines."""

    def __init__(self, engine_settings: dict[str, Any]) -> None:
        from vlm_catalog.batch.job import BatchSettings, build_engine, build_request_builder
        from vlm_catalog.batch.selection import Shard

        values = dict(engine_settings)
        values.update(dataset=Path(values["dataset"]), out=Path(values["out"]), model=Path(values["model"]),
                      shard=Shard.parse(values["shard"]))
        self.settings = BatchSettings(**values)
        self.engine = build_engine(self.settings)
        self.builder = build_request_builder(self.settings, self.engine.tokenizer)

    def __call__(self, batch) -> dict[str, list]:
        from schemas import ProductRecord
        from vlm_catalog.batch.local import run_items
        from vlm_catalog.data.loader import CatalogueItem

        items = []
        for row in batch.to_pylist():
            if row["error"]:
                items.append(CatalogueItem(row["index"], error=row["error"], kind=row["kind"]))
                continue
            record = ProductRecord(
                id=str(row["index"]), title=row["title"], description=row["description"], image=row["image"],
                candidate_categories=json.loads(row["candidates"]),
            )
            items.append(CatalogueItem(row["index"], record=record))
        lines: list[ResultLine] = []
        run_items(self.engine, self.builder, items, lines.append, self.settings.window,
                  read_ahead=self.settings.read_ahead)
        return {"line": [json.dumps({**line.to_json(), "num_tokens": line.num_tokens}) for line in lines]}
