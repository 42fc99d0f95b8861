"""What the engine returns for a request, streamed step by step and once finished."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestOutput:
    request_id: str
    text: str  # all generated text so far (what its deltas have sent; the final output: all of it)
    token_ids: list[int]  # all generated tokens so far
    num_prompt_tokens: int
    finished: bool
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    error: str | None = None
    delta_text: str = ""  # text added since the previous output of this request
    logprobs: list[dict[int, float]] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


def context_cut(output: RequestOutput, max_model_len: int) -> str | None:
    """Why an answer that finished by "length" ended, when the model's context rather than
    `max_tokens` ended it (the prompt and the answer reached `max_model_len`); else None."""
    generated = len(output.token_ids)
    if output.finish_reason != "length" or output.num_prompt_tokens + generated < max_model_len:
        return None
    return (f"the prompt ({output.num_prompt_tokens} tokens) and the answer ({generated}) "
            f"filled the model's context (max_model_len {max_model_len})")
