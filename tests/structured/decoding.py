"""A miniature engine for grammar tests: a deterministic fake model and a decode loop.

The loop drives a `GrammarState` the way the real engine does in either
jump-forward mode, without a model: logits come from `HistoryModel`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

import torch

from vlm_catalog.structured import GrammarState, allocate_bitmask, apply_bitmask

Sampling = Literal["greedy", "sample"]


class HistoryModel:
    """Logits that are a seeded function of the last `context` tokens (same history, same logits).

    Random logits alone would almost never close a free string within the
    output cap, so tokens containing a double quote get a bias that grows with
    the number of tokens since the last quote (free strings end after a few
    tokens, like real brand names).
    """

    def __init__(
        self, tokenizer, vocab_size: int, seed: int, context: int = 4, close_bias: float = 0.8
    ):
        self.vocab_size = vocab_size
        self.seed = seed
        self.context = context
        self.close_bias = close_bias
        self.quote_tokens = {t for t in range(len(tokenizer)) if '"' in tokenizer.decode([t])}
        self.quote_mask = torch.zeros(vocab_size)
        self.quote_mask[sorted(self.quote_tokens)] = 1.0

    def _generator(self, tokens: list[int], salt: str) -> torch.Generator:
        key = f"{salt}:{self.seed}:{len(tokens)}:{tokens[-self.context:]}".encode()
        digest = hashlib.blake2b(key, digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """`[1, vocab_size]` float32 logits for the next token after `tokens`."""
        logits = torch.randn(self.vocab_size, generator=self._generator(tokens, "logits"))
        since_quote = next(
            (age for age, t in enumerate(reversed(tokens)) if t in self.quote_tokens), len(tokens)
        )
        logits += (self.close_bias * since_quote) * self.quote_mask
        return logits[None]

    def pick(self, masked_logits: torch.Tensor, tokens: list[int], sampling: Sampling) -> int:
        """Greedy, or sampling whose randomness is keyed by the history (not a stream
        advanced per step), so jump-forward on and off draw the same numbers."""
        if sampling == "greedy":
            return int(masked_logits.argmax())
        probs = torch.softmax(masked_logits.float(), dim=-1)
        return int(torch.multinomial(probs, 1, generator=self._generator(tokens, "sample")))


@dataclass
class Decoded:
    tokens: list[int]
    model_steps: int
    finished: bool


def decode(
    state: GrammarState,
    model: HistoryModel,
    *,
    jump_forward: bool,
    sampling: Sampling = "greedy",
    max_tokens: int = 200,
) -> Decoded:
    """Generate until the grammar is finished or `max_tokens`; count model steps.

    ON: forced tokens are appended without model steps (one extend step follows).
    OFF: every token costs a model step; the mask forces the canonical span.
    """
    bitmask = allocate_bitmask(1, state.mask_size)
    tokens: list[int] = []
    steps = 0
    while not state.is_finished() and len(tokens) < max_tokens:
        if jump_forward:
            forced = state.forced_tokens()[: max_tokens - len(tokens)]
            state.accept(forced)
            tokens += forced
            if len(tokens) >= max_tokens:
                break
        logits = model.logits(tokens)
        state.fill_bitmask(bitmask, 0, force_canonical=not jump_forward)
        apply_bitmask(logits, bitmask, [0])
        token = model.pick(logits[0], tokens, sampling)
        state.accept([token])
        steps += 1
        if not state.is_terminated():
            tokens.append(token)
    return Decoded(tokens=tokens, model_steps=steps, finished=state.is_finished())
