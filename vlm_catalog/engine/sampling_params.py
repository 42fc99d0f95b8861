"""Per-request generation settings, in the shape vLLM users know."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

OUTPUT_KINDS = ("cumulative", "final_only")
# any signed 64-bit seed, as OpenAI's API and vLLM take it (clients send -1); the sampler folds it into
# the range torch.Generator.manual_seed takes (sampler.py, _position_seed)
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
GREEDY_BELOW_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS


class SamplingParamsError(ValueError):
    """Settings that make no sense; the message names the field, and `field` is its name."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class SamplingParams:
    """How to generate for one request.

    Greedy when `temperature` is 0 (or below 1e-5, as in vLLM). Filters apply in the order top-k, top-p,
    min-p. `seed` makes one request's random draws its own, whatever it is
    batched with (its logits can still differ in the last bits with the batch:
    `engine/sampler.py`). Constrained decoding: set at most one of `json_schema` (a
    registered schema name, a pydantic model class or a JSON-schema dict),
    `regex` or `choice`; every finished output then parses against it unless
    `finish_reason == "length"` (so stop strings, and stop tokens other than the
    end-of-answer ones, are refused beside one).

    `output_kind`: "cumulative" (the default) gives an output every step the
    request advances (text so far and the delta, for streaming); "final_only"
    gives only the finished one, which spares the engine building an output per
    request per step when nothing streams (offline and batch runs).
    """

    max_tokens: int = 150
    temperature: float = 0.0
    top_k: int = 0  # 0 or -1: all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # how many top alternatives to report per generated token (constrained: no jump-forward)
    json_schema: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    output_kind: str = "cumulative"  # or "final_only"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [] if self.stop is None else self.stop  # None as vLLM takes it: no stops
        self.stop_token_ids = [] if self.stop_token_ids is None else self.stop_token_ids
        for name in ("max_tokens", "top_k", "seed", "logprobs"):
            value = getattr(self, name)
            if value is not None and not _is_integer(value):
                raise SamplingParamsError(f"{name} must be an integer, got {value!r}", name)
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not _is_number(value):
                raise SamplingParamsError(f"{name} must be a number, got {value!r}", name)
        if not isinstance(self.stop, (list, tuple)) or not isinstance(self.stop_token_ids, (list, tuple)):
            raise SamplingParamsError("stop and stop_token_ids must be lists", "stop")
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            raise SamplingParamsError(f"seed must be a signed 64-bit integer, in [-2**63, 2**63 - 1], got {self.seed}", "seed")
        if self.max_tokens is None:
            raise SamplingParamsError("max_tokens must be an integer, got None", "max_tokens")
        if self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise SamplingParamsError(f"temperature must be in [0, 100], got {self.temperature}", "temperature")
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise SamplingParamsError(f"top_k must be 0 (off), -1 (off) or a positive integer, got {self.top_k!r}", "top_k")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SamplingParamsError(f"logprobs must be between 0 and 20, got {self.logprobs}", "logprobs")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError("stop strings must be non-empty strings", "stop")
        if any(not _is_integer(t) or t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids must be non-negative integers", "stop_token_ids")
        if self.output_kind not in OUTPUT_KINDS:
            raise SamplingParamsError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}", "output_kind")
        constraints = [c for c in (self.json_schema, self.regex, self.choice) if c is not None]
        if len(constraints) > 1:
            raise SamplingParamsError("set at most one of json_schema, regex and choice", "json_schema")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise SamplingParamsError("choice must be a non-empty list of strings", "choice")
        if constraints and self.stop:  # the engine refuses stop_token_ids (other than end-of-answer) likewise
            raise SamplingParamsError(
                "stop strings cannot be combined with json_schema, regex or choice: they would end the answer "
                "before it matches (the constraint ends it)",
                "stop",
            )

    @property
    def greedy(self) -> bool:
        """Temperatures below `GREEDY_BELOW_TEMPERATURE` are greedy, as in vLLM: dividing the logits by
        1e-38 overflowed to inf, the softmax gave NaN, and the draw picked a token past the vocabulary."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def constrained(self) -> bool:
        return self.json_schema is not None or self.regex is not None or self.choice is not None


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python, not a count


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
