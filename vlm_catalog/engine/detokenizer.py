"""Incremental detokenisation with stop strings.

The output so far is decoded as a whole each time (outputs are short: this
workload caps them at 150 tokens). A trailing replacement character means a
multi-byte character is still incomplete, so it is held back from streamed
deltas until the next token completes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Detokenizer:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)  # the model may pad its vocabulary past the tokenizer
        self.stop = list(stop)
        self.include_stop = include_stop
        self.text = ""
        self._emitted = 0  # characters of `text` already returned as deltas

    def update(self, output_token_ids: Sequence[int]) -> bool:
        """Decode the output so far; True when a stop string appeared (text truncated there)."""
        ids = [token for token in output_token_ids if token < self.vocab_size]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for stop in self.stop:
            at = text.find(stop, max(0, len(self.text) - len(stop)))
            if at != -1:
                self.text = text[: at + len(stop)] if self.include_stop else text[:at]
                return True
        self.text = text
        return False

    def delta(self, final: bool = False) -> str:
        """Text added since the last call (complete characters only, unless final)."""
        end = len(self.text)
        if not final:
            while end > self._emitted and self.text[end - 1] == "\ufffd":
                end -= 1
        new = self.text[self._emitted : end]
        self._emitted = end
        return new
