"""One batch run: check everything that can be checked before any work, then extract.

`run_batch(settings)`:
1. checks the arguments, the model directory and the output path (its folder is
   writable, it is not a folder, not a file of the dataset, not inside a dataset
   directory) and opens the dataset (not found, not a catalogue, no records):
   any problem raises `BatchError` with a one-line message before the model loads;
2. opens the results file (lock, resume: finished ids skipped, torn line cut);
3. streams the pending records (shard, limit, minus done) through the engine,
   in this process or on Ray, writing each line as it finishes;
4. returns a `BatchSummary` (and scores the file with `--eval`).

Ctrl-C (or SIGTERM) stops the run with everything finished already on disk;
`BatchSummary.interrupted` says so.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Container
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlm_catalog.batch.fingerprint import model_fingerprint
from vlm_catalog.batch.output import OutputError, ResultsFile, job_file
from vlm_catalog.batch.progress import Progress
from vlm_catalog.batch.requests import FAILURE_KINDS, ResultLine
from vlm_catalog.batch.selection import WHOLE, Shard, count_selected, pending_indices
from vlm_catalog.engine.step_faults import EngineFailing
from vlm_catalog.paths import DEFAULT_MODEL_DIR, shipped_data_hint
from vlm_catalog.signals import StopRequest

BATCH_GRAMMAR_CACHE_SIZE = 64


class BatchError(RuntimeError):
    """A run-level problem (arguments, output path, dataset, model); one line, no traceback."""


@dataclass
class BatchSettings:
    dataset: Path
    out: Path
    model: Path = DEFAULT_MODEL_DIR
    split: str | None = None
    limit: int | None = None
    schema: str = "product_metadata"
    prompt_style: str = "mlperf"
    device: str = "cpu"
    dtype: str = "auto"
    max_tokens: int = 150
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    kv_cache_dtype: str = "auto"  # "fp8": an e4m3 KV cache (EngineConfig.kv_cache_dtype)
    quantization: str = "auto"  # MoE expert weights (EngineConfig.quantization)
    gpu_memory_utilization: float = 0.9
    async_scheduling: bool | None = None  # EngineConfig.async_scheduling (None: on CUDA only; the same answers either way)
    warmup: bool | None = None  # EngineConfig.warmup (None: on CUDA only)
    shard: Shard = WHOLE
    overwrite: bool = False
    retry_failed: tuple[str, ...] = ()  # failure kinds whose records run again (their lines are removed first)
    ray_address: str | None = None  # None: this process; "": Ray (running cluster or local); else its address
    replicas: int | None = None  # Ray engine replicas (default: one per GPU, or per node on CPU)
    window: int | None = None  # requests in the engine at once (None: 64 on CPU, 512 on GPUs)
    read_ahead: int = 64  # records prepared ahead in background threads (0: on the engine thread)
    evaluate: bool = False
    log_every_s: float = 30.0
    terminal: bool | None = None  # progress bar (None: when stderr is a terminal)

    def job_identity(self, num_records: int) -> dict[str, Any]:
        """What makes two runs' answers the same (a resumed run must match it)."""
        return {
            "dataset": str(self.dataset.resolve()),
            "split": self.split,
            "num_records": num_records,
            "shard": str(self.shard),
            "model": str(Path(self.model).resolve()),
            "model_files": model_fingerprint(Path(self.model)),  # a model changed in place is another job
            "schema": self.schema,
            "prompt_style": self.prompt_style,
            "max_tokens": self.max_tokens,
            # as the engine runs: "auto" is float32 on CPU and bfloat16 on CUDA, and on CUDA an FP8
            # checkpoint's experts stay FP8 (quantization "auto"), so a CPU run does not resume on a GPU
            "dtype": engine_config(self).dtype,
            "device": "cpu" if self.device == "cpu" else "cuda",  # cuda:0 and cuda:1 give equal answers
            # an FP8 cache or FP8 experts change answers too; "auto" stays unnamed so results
            # files of earlier versions (which had no such keys) can still be resumed
            **{name: getattr(self, name) for name in ("kv_cache_dtype", "quantization") if getattr(self, name) != "auto"},
        }


@dataclass
class BatchSummary:
    out: Path
    selected: int = 0  # records of this dataset/shard/limit
    skipped: int = 0  # already in the results file when the run started
    answered: int = 0  # this run
    failures: Counter = field(default_factory=Counter)  # this run, by kind
    file_answered: int = 0  # the whole results file after the run
    file_failures: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    tokens: int = 0
    interrupted: bool = False
    repaired_bytes: int = 0
    retried: Counter = field(default_factory=Counter)  # failed records whose lines --retry-failed removed, by kind
    engine_stats: dict[str, Any] = field(default_factory=dict)
    accuracy: Any = None  # AccuracyReport with --eval

    @property
    def processed(self) -> int:
        return self.answered + sum(self.failures.values())

    @property
    def records_per_second(self) -> float:
        return self.processed / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def complete(self) -> bool:
        return not self.interrupted and self.file_answered + sum(self.file_failures.values()) >= self.selected

    def format(self) -> str:
        failed = sum(self.file_failures.values())
        kinds = _by_kind(self.file_failures)
        head = "interrupted after" if self.interrupted else "extracted"
        lines = [
            f"{head} {self.processed} records in {self.seconds:.1f} s "
            f"({self.records_per_second:.2f} records/s, {self.tokens_per_second:.0f} tokens/s)"
            + (f"; {self.skipped} already done" if self.skipped else ""),
            f"{self.out}: {self.file_answered + failed} of {self.selected} records, "
            f"{self.file_answered} answered, {failed} failed" + (f" ({kinds})" if kinds else ""),
        ]
        if self.repaired_bytes:
            lines.append(f"repaired a torn last line ({self.repaired_bytes} bytes cut)")
        if self.retried:
            lines.append(f"retried {sum(self.retried.values())} failed records ({_by_kind(self.retried)})")
        if self.interrupted:
            lines.append("run the same command again to resume")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "records": self.processed, "seconds": self.seconds, "records_per_second": self.records_per_second,
            "tokens_per_second": self.tokens_per_second, "valid_answers": self.answered,
            "failed": sum(self.failures.values()), "failures": dict(self.failures), "skipped": self.skipped,
            "model_steps": self.engine_stats.get("num_sampled_tokens", 0),
            "jump_forward_tokens": self.engine_stats.get("num_jump_forward_tokens", 0),
            "prompt_tokens_computed": self.engine_stats.get("num_prompt_tokens_computed", 0),
            "seconds_waiting_for_records": self.engine_stats.get("seconds_waiting_for_records", 0.0),
        }


def _by_kind(counts: Counter) -> str:
    return ", ".join(f"{kind}: {counts[kind]}" for kind in FAILURE_KINDS if counts[kind])


# ------------------------------------------------------------------- checks
def check_settings(settings: BatchSettings) -> None:
    from schemas import SchemaError, resolve_schema
    from vlm_catalog.preprocess.prompt import PROMPT_STYLES

    if settings.limit is not None and settings.limit < 1:
        raise BatchError(f"--limit must be a positive number of records, got {settings.limit}")
    if settings.max_tokens < 1:
        raise BatchError(f"--max-tokens must be at least 1, got {settings.max_tokens}")
    if settings.window is None:
        settings.window = 64 if settings.device == "cpu" else 512
    if settings.window < 1:
        raise BatchError(f"--window must be at least 1, got {settings.window}")
    if settings.read_ahead < 0:
        raise BatchError(f"--read-ahead must be 0 or more, got {settings.read_ahead}")
    unknown = [kind for kind in settings.retry_failed if kind not in FAILURE_KINDS]
    if unknown:
        raise BatchError(f"--retry-failed: unknown failure kind {unknown[0]!r}; the kinds are {', '.join(FAILURE_KINDS)}")
    if settings.replicas is not None and settings.replicas < 1:
        raise BatchError(f"--replicas must be at least 1, got {settings.replicas}")
    if settings.replicas is not None and settings.ray_address is None:  # before: ignored without a word
        raise BatchError("--replicas sets a Ray run's engine replicas; add --ray, or leave --replicas out")
    if settings.retry_failed and settings.overwrite:
        raise BatchError("--retry-failed reruns failed records of the --out being resumed, and --overwrite starts "
                         "it afresh: give one of them")
    if not (math.isfinite(settings.log_every_s) and settings.log_every_s > 0):  # 0 logged every record, nan never
        raise BatchError(f"--log-every must be a number of seconds above 0, got {settings.log_every_s}")
    if settings.prompt_style not in PROMPT_STYLES:
        raise BatchError(f"unknown --prompt-style {settings.prompt_style!r}; choose {', '.join(PROMPT_STYLES)}")
    try:
        model = resolve_schema(settings.schema).model
    except SchemaError as exc:
        raise BatchError(str(exc)) from None
    if model is None or "category" not in model.model_fields:
        raise BatchError(f"schema {settings.schema!r} has no category field to restrict")
    if not (Path(settings.model) / "config.json").is_file():
        raise BatchError(f"--model {settings.model}: not a checkpoint directory (no config.json)"
                         f"{shipped_data_hint(settings.model)}")
    if settings.ray_address is not None:  # the replicas load it: what they would refuse is said here, in one line
        from vlm_catalog.model.config import ModelConfigError
        from vlm_catalog.model.loader import CheckpointError, check_checkpoint

        try:
            check_checkpoint(settings.model)
        except (CheckpointError, ModelConfigError) as exc:
            raise BatchError(f"cannot load the model: {exc}") from None
    engine_config(settings)  # device, dtype and memory settings, checked before any work


def engine_config(settings: BatchSettings):
    """The EngineConfig of each engine the job builds (BatchError when a setting cannot work)."""
    from vlm_catalog.engine.arguments import DEVICE_OPTIONS
    from vlm_catalog.engine.config import EngineConfig, EngineConfigError

    try:
        return EngineConfig(
            model=settings.model, device=settings.device, dtype=settings.dtype,
            enable_prefix_caching=settings.enable_prefix_caching, scheduling_policy=settings.scheduling_policy,
            **{name: getattr(settings, name) for name in DEVICE_OPTIONS},
            # each record has its own candidate list, so its grammar is seldom seen again:
            # a small cache keeps memory flat over millions of records
            grammar_cache_size=BATCH_GRAMMAR_CACHE_SIZE,
        )
    except EngineConfigError as exc:
        raise BatchError(str(exc)) from None


def check_output_path(out: Path, catalogue, model: Path | None = None) -> None:
    """Refuse an output that cannot be written or that would touch the dataset or the model."""
    out = Path(out)
    special = str(out) == "-" or out.absolute().parts[1:2] in (("dev",), ("proc",))  # /dev/stdout, /proc/self/fd/1
    if special or (out.exists() and not out.is_dir() and not out.is_file()):
        raise BatchError(
            f"--out {out}: results go to a regular file, which a later run resumes from; not to stdout, "
            "a pipe or a device. Give a file name such as predictions.jsonl"
        )
    if out.is_dir():
        raise BatchError(f"--out {out} is a directory; give a file name such as {out / 'predictions.jsonl'}")
    resolved = out.resolve()
    inputs = {Path(file).resolve() for file in catalogue.input_files}
    if resolved in inputs:
        raise BatchError(f"--out {out} is a file of the dataset itself; choose another path")
    source = Path(catalogue.source).resolve()
    if source.is_dir() and resolved.is_relative_to(source):
        raise BatchError(f"--out {out} lies inside the dataset directory {catalogue.source}; choose a path outside it")
    if model is not None and resolved.is_relative_to(Path(model).resolve()):  # `--overwrite` emptied its config.json
        raise BatchError(f"--out {out} lies inside the model directory {model}; choose a path outside it")
    image_root = catalogue.image_root
    if image_root is not None and out.exists() and not job_file(out).exists() and resolved.is_relative_to(image_root.resolve()):
        raise BatchError(
            f"--out {out} is a file in the dataset's folder that extract did not write "
            "(it may be one of its images); choose another path"
        )
    parent = resolved.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BatchError(f"--out {out}: cannot create its folder {parent} ({exc.strerror})") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BatchError(f"--out {out}: the folder {parent} is not writable")
    if out.exists() and not os.access(out, os.W_OK):
        raise BatchError(f"--out {out} exists and is not writable")


# ---------------------------------------------------------------------- run
def run_batch(settings: BatchSettings) -> BatchSummary:
    """The run; KeyboardInterrupt when SIGINT/SIGTERM came before the first record started (nothing
    written), else `BatchSummary.interrupted`. The signals are caught from the first step: a signal
    stops the run at the next safe point (a second one at once), whether it comes while the dataset
    opens, the model loads or records run; SIGINT too where the process inherited it ignored."""
    interrupt = StopRequest(second_signal_interrupts=True)
    with interrupt:
        return _run_batch(settings, interrupt)


def _run_batch(settings: BatchSettings, interrupt: StopRequest) -> BatchSummary:
    from vlm_catalog.data.format import CatalogueError
    from vlm_catalog.data.loader import load_catalogue

    check_settings(settings)
    try:
        catalogue = load_catalogue(settings.dataset, split=settings.split)
    except CatalogueError as exc:
        raise BatchError(str(exc)) from None
    interrupt.check()
    check_output_path(settings.out, catalogue, settings.model)
    ray = None
    if settings.ray_address is not None:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise BatchError("--ray needs Ray: pip install 'ray[data]>=2.9' (the [distributed] extra)") from None

    selected = count_selected(len(catalogue), settings.shard, settings.limit)
    try:
        job = settings.job_identity(len(catalogue))
    except OSError as exc:
        raise BatchError(f"--model {settings.model}: cannot read {exc.filename} ({exc.strerror})") from None
    interrupt.check()
    try:
        results = ResultsFile.claim(settings.out, job, settings.overwrite)  # emptied only once the run can start
    except OutputError as exc:
        raise BatchError(str(exc)) from None
    summary = BatchSummary(out=settings.out, selected=selected, repaired_bytes=results.repaired_bytes)
    try:
        interrupt.check()
        # --retry-failed's lines are removed once the model has loaded (`ready`): a start that fails
        # (a model that does not load, a signal) keeps them and their errors
        retry = _failures_to_retry(catalogue, settings, results) if settings.retry_failed else set()
        summary.retried = Counter(results.done[index] for index in retry)
        summary.skipped = sum(1 for _ in _selected_done(catalogue, settings, results)) - len(retry)
        pending = pending_indices(len(catalogue), _DoneBut(results.done, retry), settings.shard, settings.limit)
        progress = Progress(selected - summary.skipped, terminal=settings.terminal, log_every_s=settings.log_every_s)
        where = "on Ray" if settings.ray_address is not None else f"on {settings.device}"
        print(f"extract: {selected - summary.skipped} of {selected} records to do {where}"
              + (f" ({summary.skipped} already in {settings.out})" if summary.skipped else "")
              + (f"; {sum(summary.retried.values())} of them failed before and run again "
                 f"({_by_kind(summary.retried)})" if summary.retried else ""),
              file=progress.stream, flush=True)
        if results.lock_warning:
            print(f"warning: {results.lock_warning}", file=progress.stream, flush=True)

        def ready() -> None:  # the model loaded: the results file may now be emptied and its job written
            try:
                results.start()
                results.forget(retry)
            except OutputError as exc:
                raise BatchError(str(exc)) from None
            progress.restart()

        if selected == summary.skipped:  # nothing to run (Ray then loads no model): ready now
            ready()

        def emit(line: ResultLine) -> None:
            if int(line.id) in results.done:
                return  # a Ray task retried after its first answer was written
            results.write(line.to_json())
            progress.update(line)

        def emit_then_check(line: ResultLine) -> None:  # Ray: the driver's loop is over lines
            emit(line)
            interrupt.check()

        try:  # a signal stops the run between engine steps (interrupt.check)
            if settings.ray_address is None:
                summary.engine_stats = _run_here(settings, catalogue.items(pending), emit, ready, interrupt.check)
            else:
                from vlm_catalog.batch.ray_runner import RayRunError, run_on_ray

                try:
                    run_on_ray(settings, list(pending), emit_then_check, ready)
                except RayRunError as exc:
                    raise BatchError(str(exc)) from None
        except KeyboardInterrupt:
            summary.interrupted = True
        except OutputError as exc:  # a full disk, or the results file deleted during the run: its message says
            raise BatchError(str(exc)) from None
        except EngineFailing as exc:  # a dead device: the records it failed are not written, and run again
            raise BatchError(f"the run stopped: {exc}; the lines written so far are kept, "
                             "and the same command resumes") from None
        except OSError as exc:  # e.g. the dataset's file went away (a lost network mount)
            raise BatchError(f"the run stopped: {exc}; the lines written so far are kept, "
                             "and the same command resumes") from None
        finally:
            progress.close()
        summary.seconds = progress.seconds
        summary.answered, summary.failures, summary.tokens = progress.answered, progress.failures, progress.tokens
        selected_done = list(_selected_done(catalogue, settings, results))
        summary.file_failures = Counter(kind for kind in selected_done if kind is not None)
        summary.file_answered = sum(1 for kind in selected_done if kind is None)
    finally:
        try:
            results.close()
        except OutputError as exc:  # as above; or a cut line's last bytes still cannot be written
            raise BatchError(str(exc)) from None
    summary.interrupted = summary.interrupted or interrupt.requested is not None  # a signal after the last record
    if settings.evaluate and not summary.interrupted:
        try:
            summary.accuracy = evaluate_results(settings, catalogue)
        except KeyboardInterrupt:  # a second signal while scoring: the records are all on disk
            summary.interrupted = True
    return summary


def _failures_to_retry(catalogue, settings: BatchSettings, results: ResultsFile) -> set[int]:
    """The selected records that failed with a `--retry-failed` kind: this run does them again."""
    from vlm_catalog.batch.selection import selected_indices

    kinds = set(settings.retry_failed)
    return {
        index for index in selected_indices(len(catalogue), settings.shard, settings.limit)
        if results.done.get(index) in kinds
    }


@dataclass(frozen=True)
class _DoneBut:
    """The records in the results file, but for those `--retry-failed` runs again (their lines are
    removed only once the model has loaded)."""

    done: Container[int]
    retry: Container[int]

    def __contains__(self, index: object) -> bool:
        return index in self.done and index not in self.retry


def _selected_done(catalogue, settings: BatchSettings, results: ResultsFile):
    """Failure kind (None: answered) of each selected record already in the file."""
    from vlm_catalog.batch.selection import selected_indices

    for index in selected_indices(len(catalogue), settings.shard, settings.limit):
        if index in results.done:
            yield results.done[index]


def _run_here(settings: BatchSettings, items, emit, on_ready, between_steps) -> dict[str, Any]:
    from dataclasses import asdict

    from vlm_catalog.batch.local import run_items

    engine = build_engine(settings)
    between_steps()  # a signal while the model loaded
    on_ready()
    try:
        feed = run_items(engine, build_request_builder(settings, engine.tokenizer), items, emit, settings.window,
                         between_steps, settings.read_ahead)
        return {**engine.stats.as_dict(), **asdict(feed)}
    finally:
        engine.close()


def build_engine(settings: BatchSettings):
    from vlm_catalog.engine.config import EngineConfigError
    from vlm_catalog.engine.llm_engine import LLMEngine
    from vlm_catalog.model.config import ModelConfigError
    from vlm_catalog.model.loader import CheckpointError

    config = engine_config(settings)
    try:
        return LLMEngine(config)
    except (CheckpointError, ModelConfigError, EngineConfigError) as exc:
        raise BatchError(f"cannot load the model: {exc}") from None


def build_request_builder(settings: BatchSettings, tokenizer):
    from schemas import resolve_schema
    from vlm_catalog.batch.requests import RequestBuilder
    from vlm_catalog.structured.catalogue import token_counter

    return RequestBuilder(resolve_schema(settings.schema).model, settings.prompt_style, settings.max_tokens,
                          token_counter(tokenizer))


def evaluate_results(settings: BatchSettings, catalogue):
    """The benchmark's accuracy over the records in the results file (None without ground truth)."""
    from schemas import resolve_schema
    from vlm_catalog.evaluate.command import resolve_indices
    from vlm_catalog.evaluate.predictions import read_predictions
    from vlm_catalog.evaluate.scoring import score

    if not catalogue.has_labels:
        return None
    from vlm_catalog.evaluate.predictions import PredictionsError

    labels = catalogue.labels_or_none()
    try:
        predictions = read_predictions(settings.out)
    except PredictionsError:  # an empty file: nothing to score
        return None
    responses = sorted(  # in record order: the random baseline draws in this order
        (index, response) for index, response in resolve_indices(predictions, catalogue)
        if labels[index] is not None
    )
    if not responses:
        return None
    return score(responses, labels, answer_schema=resolve_schema(settings.schema).model)
