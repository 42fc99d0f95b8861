"""Incremental detokenisation with stop strings.

Tokens go through a `tokenizers` `DecodeStream` as they come, so each token
costs the same whatever the output's length (decoding the whole output again
every step made a 150-token answer cost 150 decodes of up to 150 tokens). The
stream holds a token back until the character it starts is complete, so a
multi-byte character is never cut in a streamed delta. With stop strings (cut
from the text), a delta also holds back the last characters that could begin
one (the longest stop's length less one), so a stream never sends part of a
stop string that the final text leaves out; an output's `text` is what its
deltas have sent (`shown`). The final text is the whole output decoded once,
as `tokenizer.decode` gives it, less an unfinished character at the very end
(U+FFFD there; vLLM leaves it out too) and less the text of a `stop_token_ids`
token that ended it (unless `include_stop`), searched for stop strings once
more: the token held back for an unfinished character may complete one.

Tokenizers without a `tokenizers` backend decode the whole output each time
instead. Neither way cleans up spaces after decoding (`clean_up_tokenization_spaces`,
which vLLM does not apply either): it rewrites text already sent, so the deltas
of such a tokenizer did not add up to its final text ("a  b  c " for "a, b. c?").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream


class Detokenizer:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), include_stop: bool = False,
                 stop_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)  # the model may pad its vocabulary past the tokenizer
        self.stop = list(stop)
        self.include_stop = include_stop
        self.stop_token_ids = frozenset(stop_token_ids)
        # characters a streamed delta holds back: a stop string may begin in them
        self._held_back = 0 if include_stop or not self.stop else max(map(len, self.stop)) - 1
        self.text = ""
        self.stopped = False  # a stop string was found; `text` ends there
        self._emitted = 0  # characters of `text` already returned as deltas
        self._fed = 0  # output tokens seen so far
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = DecodeStream(skip_special_tokens=True) if self._backend is not None else None

    def update(self, output_token_ids: Sequence[int]) -> bool:
        """Take the output so far (a longer list each call); True once a stop string appeared
        (the text is then cut there, and later calls change nothing)."""
        if self.stopped:
            return True
        searched_from = len(self.text)
        if self._stream is None:
            self.text = self._decode_all(output_token_ids)
        else:
            for token in output_token_ids[self._fed:]:
                if token < self.vocab_size:
                    chunk = self._stream.step(self._backend, token)
                    if chunk:
                        self.text += chunk
        self._fed = len(output_token_ids)
        return self._cut_at_stop(searched_from)

    def _cut_at_stop(self, searched_from: int) -> bool:
        """Cut `text` at the first stop string that ends past `searched_from`; True if one did."""
        found = [(at, stop) for stop in self.stop if (at := self.text.find(stop, max(0, searched_from - len(stop)))) != -1]
        if not found:
            return False
        at, stop = min(found, key=lambda hit: hit[0])  # the first to appear, whatever its place in the list
        self.text = self.text[: at + len(stop)] if self.include_stop else self.text[:at]
        self.stopped = True
        return True

    def finish(self, output_token_ids: Sequence[int]) -> None:
        """Settle the final text (the module docstring): the whole output decoded once, unless a stop
        string cut it."""
        if output_token_ids and output_token_ids[-1] in self.stop_token_ids and not self.include_stop:
            output_token_ids = output_token_ids[:-1]  # as vLLM: the stop token's text is left out
        if self.update(output_token_ids):
            return
        searched_from = len(self.text)
        # an unfinished character at the end reads as U+FFFD, which a stream (and vLLM's) cannot tell
        # from a U+FFFD written whole: at the very end both are left out; inside the text both stay
        self.text = self._decode_all(output_token_ids).rstrip("\ufffd")
        self._cut_at_stop(searched_from)

    @property
    def shown(self) -> str:
        """The text the deltas have returned so far."""
        return self.text[: self._emitted]

    def delta(self, final: bool = False) -> str:
        """Text added since the last call (complete characters only, unless final)."""
        end = len(self.text)
        if not final:
            if not self.stopped:  # what may yet turn out to begin a stop string
                end = max(self._emitted, end - self._held_back)
            while end > self._emitted and self.text[end - 1] == "\ufffd":
                end -= 1
        new = self.text[self._emitted : end]
        self._emitted = end
        return new

    def _decode_all(self, output_token_ids: Sequence[int]) -> str:
        ids = [token for token in output_token_ids if token < self.vocab_size]
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
