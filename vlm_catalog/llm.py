"""Offline API in the shape vLLM users know.

    from vlm_catalog import LLM, SamplingParams
    llm = LLM(model="path/to/checkpoint", device="cpu", dtype="float32")
    outs = llm.chat(list_of_message_lists, SamplingParams(max_tokens=150, json_schema=ProductMetadata))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason, outs[0].metrics
    llm.extract(records)   # ProductRecord -> ProductMetadata with the mlperf prompt

A request that cannot run (unreadable image, prompt too long, invalid schema)
comes back as an output with `finish_reason == "error"` and an `error` message;
the others are unaffected. Calls from several threads on one `LLM` run one after
another (the engine steps one batch at a time); for concurrent callers, use
`AsyncLLM`.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from schemas import ProductMetadata, ProductRecord
from vlm_catalog.engine.config import EngineConfig
from vlm_catalog.engine.llm_engine import EngineRequestError, LLMEngine
from vlm_catalog.engine.outputs import RequestOutput, context_cut
from vlm_catalog.engine.sampling_params import SamplingParams
from vlm_catalog.engine.step_faults import FailedStepRetries
from vlm_catalog.paths import DEFAULT_MODEL_DIR
from vlm_catalog.preprocess.processor import ProcessedPrompt
from vlm_catalog.read_ahead import ReadAhead

Messages = list[dict[str, Any]]
JOIN_PER_STEP = 64  # prompts queued before a step at most (the queue holds max(64, max_num_seqs))


@dataclass
class Extraction:
    """The result for one product: parsed metadata, or why there is none."""

    record_id: str | None
    metadata: BaseModel | None
    text: str
    finish_reason: str | None
    error: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.metadata is not None


class LLM:
    def __init__(self, model: str | Path = DEFAULT_MODEL_DIR, device: str = "cpu", dtype: str = "auto", **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, **engine_options))
        self._request_counter = itertools.count()
        self._running = threading.Lock()  # one call drives the engine at a time (see the module doc)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for one conversation or a list of them; outputs in input order."""
        if isinstance(messages, (str, bytes, dict)):
            raise TypeError(
                f"chat() takes a conversation (a list of message dicts with 'role' and 'content') "
                f"or a list of conversations, got a {type(messages).__name__}"
            )
        if messages and isinstance(messages[0], dict):
            messages = [messages]  # a single conversation
        return self._run_prompts(list(messages), sampling_params, use_tqdm)

    def generate(
        self,
        prompts: Sequence[ProcessedPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for already processed prompts (see `PromptProcessor`)."""
        if isinstance(prompts, (str, bytes, ProcessedPrompt)):
            raise TypeError(
                f"generate() takes a list of ProcessedPrompt (see PromptProcessor; chat() takes messages), "
                f"got a {type(prompts).__name__}"
            )
        return self._run_prompts(list(prompts), sampling_params, use_tqdm)

    def extract(
        self,
        records: Iterable[ProductRecord],
        schema: type[BaseModel] = ProductMetadata,
        prompt_style: str = "mlperf",
        sampling_params: SamplingParams | None = None,
        restrict_categories: bool = True,
        use_tqdm: bool = False,
    ) -> list[Extraction]:
        """Catalogue extraction: one validated `schema` instance per record (or the reason there is none).

        With `restrict_categories`, each record's answer is constrained to a
        schema whose `category` is an enum of that record's candidates, and
        every answer is complete and valid within `sampling_params.max_tokens`
        (or within what the context leaves after the prompt, when that is less):
        a tight budget gets the bounded schema at once, and an answer the budget
        cuts is run again with it (see `budgeted_catalogue_schema`). A budget
        below an answer's fixed parts (keys, the longest candidate, the longest
        value of each closed field) is raised to them, with an empty `brand`
        (docs/batch-job.md, "Token budget").
        A record that cannot run (an unreadable or oversized image, bad
        candidates, a prompt longer than the model's context) comes back with
        its error; the others are unaffected. Where the context leaves less
        than an answer's fixed parts, an answer it cuts says so.
        """
        if sampling_params is not None:
            _check_params_type(sampling_params)
        records = list(records)
        base = sampling_params or SamplingParams(max_tokens=150, temperature=0.0)
        outputs, bounded = self._extract_pass(
            records, [False] * len(records), schema, prompt_style, base, restrict_categories, use_tqdm
        )
        # an answer the budget cut under the plain schema runs again with the bounded one
        again = [
            i for i, output in enumerate(outputs)
            if output.finish_reason == "length" and restrict_categories and not bounded[i]
        ]
        if again:
            retried, _ = self._extract_pass(
                [records[i] for i in again], [True] * len(again), schema, prompt_style, base, True, False
            )
            for i, output in zip(again, retried):
                outputs[i] = output
        max_model_len = self.engine.config.max_model_len
        return [_extraction(record, output, schema, max_model_len) for record, output in zip(records, outputs)]

    def _extract_pass(self, records, bounded, schema, prompt_style, base, restrict_categories, use_tqdm):
        """One engine run over `records`; a record whose budget is tight gets the bounded
        schema at once (`record_schema`, as in `vlm_catalog.batch.requests`)."""
        from vlm_catalog.preprocess.prompt import build_messages
        from vlm_catalog.structured.catalogue import record_schema, token_counter

        bounded = list(bounded)  # written by the preparing threads, each at its own index
        count_tokens = token_counter(self.tokenizer)

        def prepare(index: int) -> _Prepared:
            record = records[index]
            json_schema, budget = schema, base.max_tokens
            try:
                prompt = self.engine.processor.process(build_messages(record, style=prompt_style, schema=schema))
                if restrict_categories:  # the budget also fits what the context leaves after the prompt
                    json_schema, budget, bounded[index] = record_schema(
                        record.candidate_categories, base.max_tokens, count_tokens, schema, bounded[index],
                        answer_room=self.engine.answer_room(prompt),
                    )
            except ValueError as exc:  # PromptError, ImageDecodeError (a decompression bomb too), GrammarError
                return _Prepared(None, base, str(exc))
            return _Prepared(prompt, replace(_with_schema(base, json_schema, budget), output_kind="final_only"))

        return self._run(len(records), prepare, use_tqdm), bounded

    def _run_prompts(self, prompts: list, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            if not isinstance(sampling_params, Sequence) or isinstance(sampling_params, str):
                raise TypeError(
                    "sampling_params must be a SamplingParams or a list of them, "
                    f"got a {type(sampling_params).__name__}"
                )
            params = list(sampling_params)
            for p in params:
                _check_params_type(p)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        # only finished outputs are returned, so the engine need not build one per step
        # (one copy per distinct params object: a list often repeats one object)
        final_only = {id(p): replace(p, output_kind="final_only") for p in params}
        params = [final_only[id(p)] for p in params]
        return self._run(len(prompts), lambda index: self._processed(prompts[index], params[index]), use_tqdm)

    def _processed(self, prompt: Messages | ProcessedPrompt, params: SamplingParams) -> _Prepared:
        """The prompt processed as the engine takes it (chat template, tokens, image headers), or why not."""
        if isinstance(prompt, ProcessedPrompt):
            return _Prepared(prompt, params)
        try:
            return _Prepared(self.engine.processor.process(prompt), params)
        except ValueError as exc:  # PromptError, ImageDecodeError, template errors: as add_request reports them
            return _Prepared(None, params, str(exc))

    def _run(self, count: int, prepare: Callable[[int], _Prepared], use_tqdm: bool) -> list[RequestOutput]:
        """Run `prepare(0) ... prepare(count - 1)` through the engine; outputs in that order.

        Prompts are prepared in background threads (`ReadAhead`) while the engine
        steps, and queued only while fewer than `max(64, max_num_seqs)` requests
        wait in the engine, at most 64 of them before each step: the device does
        not idle while a long list is prepared (the first step waits for 64
        preparations), and a step can still fill every free sequence slot once
        the queue has grown. Which requests share a step does not depend on timing.
        """
        with self._running:
            return self._run_alone(count, prepare, use_tqdm)

    def _run_alone(self, count: int, prepare: Callable[[int], _Prepared], use_tqdm: bool) -> list[RequestOutput]:
        """`_run`'s loop. A step that raises has its requests run again, by bisection; one that fails
        alone is an "error" output (`FailedStepRetries`): a one-off fault costs no answer, and a request that
        fails every step fails alone. `EngineFailing` when the engine fails every step."""
        engine = self.engine
        ahead = max(JOIN_PER_STEP, engine.config.max_num_seqs)
        request_ids = [f"llm-{next(self._request_counter)}" for _ in range(count)]
        index_of = {request_id: index for index, request_id in enumerate(request_ids)}
        results: dict[str, RequestOutput] = {}
        progress = _progress(count, use_tqdm)
        retries: FailedStepRetries[int] = FailedStepRetries(engine)  # by the prompt's index

        def finish(outputs: Iterable[RequestOutput]) -> None:
            for output in outputs:
                results[output.request_id] = output
                progress.update(1)

        def finish_confirmed_failures(finished: bool = False) -> None:
            finish(RequestOutput(request_ids[index], "", [], 0, True, "error", f"internal engine error: {error}")
                   for index, error in retries.confirmed_failures(finished))

        queued = 0
        try:
            with ReadAhead(range(count), prepare, depth=ahead) as prepared_prompts:
                while True:
                    for index in retries.next_group(idle=not engine.has_unfinished_requests()):
                        finish(filter(None, [self._queue(prepare(index), request_ids[index])]))
                    if not retries.isolating:
                        for _ in range(JOIN_PER_STEP):
                            if queued == count or engine.num_waiting_requests >= ahead:
                                break
                            finish(filter(None, [self._queue(prepared_prompts.next(), request_ids[queued])]))
                            queued += 1
                    if not engine.has_unfinished_requests():
                        if queued == count and not retries.suspects_left:
                            finish_confirmed_failures(finished=True)
                            break
                        continue  # everything queued so far failed before reaching the engine
                    result = retries.step()
                    if result.error is not None:
                        retries.dropped([index_of[request_id] for request_id in result.dropped if request_id in index_of])
                    finish_confirmed_failures()
                    finish(output for output in result.outputs if output.finished)
        finally:
            progress.close()
            for request_id in request_ids[:queued]:  # an interrupted run leaves nothing running
                if request_id not in results:
                    engine.abort(request_id)
        return [results[request_id] for request_id in request_ids]

    def _queue(self, prepared: _Prepared, request_id: str) -> RequestOutput | None:
        """Add the prepared prompt to the engine; the error output instead if it cannot run."""
        error = prepared.error
        if error is None:
            try:
                self.engine.add_request(prepared.prompt, prepared.params, request_id=request_id)
                return None
            except EngineRequestError as exc:
                error = str(exc)
        return RequestOutput(request_id, "", [], 0, True, "error", error)


@dataclass
class _Prepared:
    """A prompt ready for `LLMEngine.add_request`, or the error that keeps it out."""

    prompt: ProcessedPrompt | None
    params: SamplingParams
    error: str | None = None


def _check_params_type(params: Any) -> None:
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be SamplingParams, got a {type(params).__name__}")


def _with_schema(params: SamplingParams, json_schema: Any, max_tokens: int) -> SamplingParams:
    values = {name: getattr(params, name) for name in params.__dataclass_fields__}
    values.update(json_schema=json_schema, regex=None, choice=None, max_tokens=max_tokens)
    return SamplingParams(**values)


def _extraction(record: ProductRecord, output: RequestOutput, schema: type[BaseModel], max_model_len: int) -> Extraction:
    metadata, error = None, output.error
    if output.finish_reason != "error":
        try:
            metadata = schema.model_validate_json(output.text)
        except ValidationError as exc:
            cut_by_context = context_cut(output, max_model_len)
            reason = output.finish_reason if cut_by_context is None else f"length: {cut_by_context}"
            error = f"answer does not validate ({reason}): {exc.errors()[0]['msg']}"
    return Extraction(record.id, metadata, output.text, output.finish_reason, error, output.metrics)


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req")
