"""What the engine returns for a request, streamed step by step and once finished."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestOutput:
    request_id: str
    text: str  # all generated text so far
    token_ids: list[int]  # all generated tokens so far
    num_prompt_tokens: int
    finished: bool
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    error: str | None = None
    delta_text: str = ""  # text added since the previous output of this request
    logprobs: list[dict[int, float]] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
