"""The two request styles the harness can send for one catalogue record.

- "mlperf": what the MLCommons reference harness (`multimodal/qwen3-vl`,
  `task.py`) sends: the mlperf prompt with the image re-encoded by Pillow in
  its own format (`reencode_like_reference`), no guided decoding, and the
  sampling settings of the checkpoint's `generation_config.json` (the reference
  leaves them to the server, which reads that file).
- "ours": what `LLM.extract` sends: the mlperf prompt with the original image
  bytes, the answer constrained to the per-record schema (`category` an enum of
  the record's candidates) and greedy decoding.

Both cap the answer at `max_tokens` (150, as the benchmark's submitters do).
A `PreparedRequest` is what the QSL keeps in memory for one sample; the
in-process SUT turns it into `SamplingParams`, the HTTP SUT into the keyword
arguments of `chat.completions.create`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas import OutputSchema, ProductMetadata, ProductRecord
from vlm_catalog.engine.generation_config import (  # noqa: F401 - Sampling, GREEDY: part of this module's API
    GREEDY,
    GenerationConfigError,
    Sampling,
    generation_config_sampling,
)
from vlm_catalog.engine.sampling_params import SamplingParams
from vlm_catalog.preprocess.prompt import build_messages, build_mlperf_messages

REQUEST_STYLES = ("mlperf", "ours")
RESPONSE_FORMAT_NAME = "product_metadata"


class RequestStyleError(ValueError):
    """A request style or checkpoint setting the harness cannot reproduce."""


@dataclass(frozen=True)
class PreparedRequest:
    """One sample ready to send: chat messages and, for "ours", the answer's JSON schema."""

    messages: list[dict[str, Any]]
    schema: OutputSchema | None  # the per-record schema; None: no guided decoding

    def sampling_params(self, sampling: Sampling, max_tokens: int) -> SamplingParams:
        """Settings for the in-process engine."""
        return sampling.params(max_tokens=max_tokens, json_schema=self.schema)

    def openai_arguments(self, sampling: Sampling, max_tokens: int, model: str) -> dict[str, Any]:
        """Keyword arguments of `AsyncOpenAI().chat.completions.create` for this sample."""
        arguments: dict[str, Any] = {
            "model": model,
            "messages": self.messages,
            "max_tokens": max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
        }
        if sampling.top_k:
            arguments["extra_body"] = {"top_k": sampling.top_k}
        if self.schema is not None:
            arguments["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": RESPONSE_FORMAT_NAME, "schema": self.schema.json_schema, "strict": True},
            }
        return arguments


def prepare_request(record: ProductRecord, style: str) -> PreparedRequest:
    """Build the request of `style` for `record`; raises `PromptError` for an unusable record."""
    if style == "mlperf":
        return PreparedRequest(build_mlperf_messages(record, ProductMetadata, reencode_image=True), None)
    if style == "ours":
        from vlm_catalog.structured import catalogue_schema

        schema = catalogue_schema(record.candidate_categories, ProductMetadata)
        return PreparedRequest(build_messages(record, "mlperf", ProductMetadata), schema)
    raise RequestStyleError(f"unknown request style {style!r}; choose one of {', '.join(REQUEST_STYLES)}")


def style_sampling(style: str, model_dir: str | Path) -> Sampling:
    """Decoding settings of a style: the checkpoint's for "mlperf", greedy for "ours"."""
    if style != "mlperf":
        return GREEDY
    try:
        return generation_config_sampling(model_dir)
    except GenerationConfigError as exc:
        raise RequestStyleError(str(exc)) from None
