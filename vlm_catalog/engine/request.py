"""One generation request as the engine tracks it.

A request holds all its tokens (prompt, then outputs) and how many of them
have their KV computed (`num_computed_tokens`). The scheduler only ever
decides how many of the not-yet-computed tokens to run this step: a prefill is
"all of them", a chunked prefill "some of them", a decode "the one new token",
a recompute after preemption "all of them again", and tokens appended by
jump-forward are simply more uncomputed tokens. The request samples when a
step computes up to its last token.
"""

from __future__ import annotations

import enum
import time
from array import array
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from vlm_catalog.engine.block_hash import block_hashes
from vlm_catalog.engine.sampling_params import SamplingParams
from vlm_catalog.preprocess.processor import ProcessedPrompt

# a token sampled on the device that the host has not read yet (async scheduling): it holds
# the token's place in `token_ids` so the next step can be scheduled before it is known
PLACEHOLDER_TOKEN = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # stop token, stop string, or the grammar completed
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"
    ERROR = "error"


@dataclass
class RequestMetrics:
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    num_preemptions: int = 0
    num_jump_forward_tokens: int = 0  # tokens appended without a model step
    num_model_steps: int = 0  # steps that sampled a token for this request

    def as_dict(self) -> dict[str, Any]:
        def since_arrival(moment: float | None) -> float | None:
            return None if moment is None else moment - self.arrival_time

        return {
            "queue_time": since_arrival(self.first_scheduled_time),
            "time_to_first_token": since_arrival(self.first_token_time),
            "latency": since_arrival(self.finished_time),
            "num_cached_tokens": self.num_cached_tokens,
            "num_preemptions": self.num_preemptions,
            "num_jump_forward_tokens": self.num_jump_forward_tokens,
            "num_model_steps": self.num_model_steps,
        }


class Request:
    def __init__(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.token_ids = array("i", prompt.token_ids)
        self.num_prompt_tokens = len(prompt.token_ids)
        self.max_total_tokens = min(self.num_prompt_tokens + params.max_tokens, max_model_len)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.metrics = RequestMetrics()
        self.grammar: Any = None  # structured-decoding state, once compiled
        self.grammar_future: Future | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.output_logprobs: list[dict[int, float]] = []
        self._block_hashes: list[bytes] = []
        self.image_hashes = [image.content_hash for image in prompt.images]

    # ------------------------------------------------------------------ sizes
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def has_placeholder(self) -> bool:
        """The last token is a placeholder: sampled on the device, not yet read (async scheduling)."""
        return bool(self.token_ids) and self.token_ids[-1] == PLACEHOLDER_TOKEN

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens the host knows (a trailing placeholder left out)."""
        return self.token_ids[self.num_prompt_tokens : self.num_tokens - self.has_placeholder].tolist()

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    # -------------------------------------------------------------- contents
    def positions(self, start: int, end: int) -> torch.Tensor:
        """MRoPE positions [3, end - start] of tokens start..end-1 (prompt, then decode)."""
        prompt_end = min(end, self.num_prompt_tokens)
        pieces = []
        if start < prompt_end:
            pieces.append(self.prompt.positions[:, start:prompt_end])
        if end > self.num_prompt_tokens:
            first = max(start, self.num_prompt_tokens)
            decode = torch.arange(first, end) + self.prompt.mrope_delta
            pieces.append(decode.unsqueeze(0).expand(3, -1))
        return torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]

    def block_hashes(self, block_size: int) -> list[bytes]:
        """Content hashes of the request's full blocks (computed incrementally); a block that
        ends at a placeholder is not full yet (its last token is unknown)."""
        done = len(self._block_hashes)
        if (done + 1) * block_size <= self.num_tokens - self.has_placeholder:
            previous = self._block_hashes[-1] if done else b""
            known = self.token_ids[:-1] if self.has_placeholder else self.token_ids
            self._block_hashes.extend(
                block_hashes(known, block_size, self.prompt.image_spans, self.image_hashes, done, previous)
            )
        return self._block_hashes

    def append_tokens(self, tokens: list[int]) -> None:
        self.token_ids.extend(tokens)

    def append_placeholder(self) -> None:
        """Hold the place of a token sampled on the device (async scheduling)."""
        if self.has_placeholder:
            raise RuntimeError(f"request {self.request_id} already waits for a sampled token")
        self.token_ids.append(PLACEHOLDER_TOKEN)

    def resolve_placeholder(self, token: int | None) -> None:
        """Put the sampled token in its place; None drops the place (the request ended meanwhile)."""
        if not self.has_placeholder:
            raise RuntimeError(f"request {self.request_id} has no sampled token pending")
        if token is None:
            self.token_ids.pop()
        else:
            self.token_ids[-1] = token

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error
        self.metrics.finished_time = time.perf_counter()
