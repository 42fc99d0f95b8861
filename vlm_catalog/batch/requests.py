"""From a catalogue item to an engine request, and from an engine output to a result line.

Shared by the single-process runner and the Ray workers, so both produce the
same lines for the same record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from schemas import ProductRecord
from vlm_catalog.engine.outputs import context_cut
from vlm_catalog.engine.sampling_params import SamplingParams
from vlm_catalog.preprocess.image_decode import DecodeFailure

# Failure kinds, as counted in the summary and written in each line's `failure`.
FAILURE_KINDS = ("image", "record", "engine", "length", "answer")
_IMAGE_REASONS = tuple(f"[{reason.value}]" for reason in DecodeFailure)


@dataclass
class ResultLine:
    """One line of the results file (today's fields, plus `failure`: null or its kind)."""

    id: str
    response: str = ""
    parsed: dict[str, Any] | None = None
    finish_reason: str | None = None
    error: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    failure: str | None = None
    num_tokens: int = 0  # output tokens (for tokens/s), not written

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "response": self.response, "parsed": self.parsed,
            "finish_reason": self.finish_reason, "error": self.error, "metrics": self.metrics,
            "failure": self.failure,
        }

    @classmethod
    def failed(cls, record_id: str, kind: str, error: str) -> ResultLine:
        return cls(id=record_id, finish_reason="error", error=error, failure=kind)


class RequestBuilder:
    """Messages and sampling parameters for a record: the mlperf (or concise) prompt,
    the per-record schema, greedy decoding.

    The token budget is `max_tokens`, or what the context leaves after the
    prompt when that is less. When it is tight (`budget_is_tight`: less than
    `TIGHT_BUDGET_MARGIN_TOKENS` beyond the answer's fixed parts), the record
    gets the bounded schema (`budgeted_catalogue_schema`) at once. Otherwise
    it gets the plain per-record schema (cheaper to compile), and an answer the
    budget cuts is run again with the bounded one (`params(record, bounded=True)`),
    which always completes. Either way every answer is valid.
    """

    def __init__(
        self,
        schema: type[BaseModel],
        prompt_style: str,
        max_tokens: int,
        count_tokens: Callable[[str], int],
    ) -> None:
        self.schema = schema
        self.prompt_style = prompt_style
        self.max_tokens = max_tokens
        self.count_tokens = count_tokens

    def messages(self, record: ProductRecord) -> list[dict[str, Any]]:
        """The record's chat messages; ValueError (PromptError) for a record that cannot make a prompt."""
        from vlm_catalog.preprocess.prompt import build_messages

        return _raw_image_parts(build_messages(record, style=self.prompt_style, schema=self.schema), record.image)

    def params(
        self, record: ProductRecord, bounded: bool = False, answer_room: int | None = None
    ) -> tuple[SamplingParams, bool]:
        """(params, whether the schema is bounded). `answer_room`: what the context leaves after
        the record's prompt (`LLMEngine.answer_room`), which caps the budget. ValueError
        (GrammarError) for a record that cannot run."""
        from vlm_catalog.structured.catalogue import record_schema

        json_schema, budget, bounded = record_schema(
            record.candidate_categories, self.max_tokens, self.count_tokens, self.schema, bounded, answer_room
        )
        return SamplingParams(
            max_tokens=budget, temperature=0.0, json_schema=json_schema, output_kind="final_only"
        ), bounded

    def result(self, record_id: str, output, max_model_len: int | None = None) -> ResultLine:
        """The line for a finished `RequestOutput` (`max_model_len`: the engine's, to say whether
        the context rather than `--max-tokens` cut an answer)."""
        line = ResultLine(
            id=record_id, response=output.text, finish_reason=output.finish_reason,
            error=output.error, metrics=dict(output.metrics or {}), num_tokens=len(output.token_ids),
        )
        if output.finish_reason == "error":
            line.failure = failure_kind_of_error(output.error or "")
            return line
        if output.finish_reason == "length":
            line.failure = "length"
            cut_by_context = None if max_model_len is None else context_cut(output, max_model_len)
            line.error = f"the answer was cut at {len(output.token_ids)} tokens ({cut_by_context or '--max-tokens'})"
            return line
        try:
            line.parsed = self.schema.model_validate_json(output.text).model_dump(mode="json")
        except ValueError as exc:  # pydantic's ValidationError
            line.failure = "answer"
            line.error = f"answer does not validate ({output.finish_reason}): {_first_problem(exc)}"
        return line


def failure_kind_of_error(message: str) -> str:
    """"image" for an engine error about an image (its reason tag, e.g. "[truncated]"), else "engine"."""
    return "image" if any(tag in message for tag in _IMAGE_REASONS) else "engine"


def _first_problem(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    return errors()[0]["msg"] if callable(errors) else str(exc)


def _raw_image_parts(messages: list[dict[str, Any]], image: bytes) -> list[dict[str, Any]]:
    """The messages with each data-URI image part replaced by the record's raw bytes.

    The prompt text is unchanged (the template renders one placeholder either
    way); a queued request then holds the original bytes, not a base64 copy.
    """
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = [
                {"type": "image", "image": image} if part.get("type") == "image_url" else part
                for part in content
            ]
    return messages
