"""The tokenizer as constrained decoding sees it: xgrammar's token table, the
model's (padded) vocabulary size, the stop tokens and a canonical encoder.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import torch
import xgrammar as xgr

from vlm_catalog.structured.bitmask import BITS_PER_WORD
from vlm_catalog.structured.errors import GrammarError

ENCODE_CACHE_SIZE = 4096

_ordinary_encoders: weakref.WeakKeyDictionary[Any, Callable[[str], list[int]]] = weakref.WeakKeyDictionary()
_ordinary_encoders_lock = threading.Lock()


def ordinary_text_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """`encode(text)` -> ids, no special tokens added, with text that reads as a special token
    ("<|im_end|>" in a category) tokenised as the ordinary text it is: how an answer must spell
    it, since no grammar allows a special id there. One per tokenizer, on a private copy of its
    Rust backend: transformers' `split_special_tokens=True` sets a flag on the shared backend at
    each call, a race with the threads that tokenise prompts (a prompt lost its image
    placeholders). A tokenizer without a Rust backend encodes as it does (special tokens read)."""
    with _ordinary_encoders_lock:
        encoder = _ordinary_encoders.get(tokenizer)
        if encoder is None:
            backend = getattr(tokenizer, "backend_tokenizer", None)
            if backend is None:
                def encoder(text: str) -> list[int]:
                    return tokenizer.encode(text, add_special_tokens=False)
            else:
                from tokenizers import Tokenizer

                private = Tokenizer.from_str(backend.to_str())
                private.encode_special_tokens = True
                private.no_truncation()  # the copy took the shared one's state of the moment: a
                private.no_padding()  # call with truncation=True left every count cut at its max_length

                def encoder(text: str) -> list[int]:
                    return private.encode(text, add_special_tokens=False).ids
            _ordinary_encoders[tokenizer] = encoder
        return encoder


class GrammarVocabulary:
    """Shared, read-only token information for every grammar of one model.

    `vocab_size` is the model's logits width, which may exceed `len(tokenizer)`
    (Qwen pads 151,665 tokens to 151,936). No grammar ever allows a padding id or
    a special token other than the stop tokens: xgrammar's `from_huggingface`
    would read `<|image_pad|>` or `<|im_start|>` as their literal text, valid
    inside any JSON string, so their entries are blanked (xgrammar's mark for
    "not text") before the token table is built.

    xgrammar's table covers only `mask_size` ids: the tokenizer's, padded to a whole
    bitmask word (32 ids). Bitmask rows are that wide, and `apply_bitmask` disallows
    the logits' columns past them. xgrammar walks its blanked ids on every mask fill and
    token accept, so a table as wide as the logits cost in proportion to the padding:
    with the 4,096-token tokenizer under a 151,936-wide head (bench_gpu.py's random
    30B-shape model), 256 requests sampling among their allowed tokens took 60 ms to fill
    and 9.7 ms to advance per step on the 2-core VM, and 3.1 and 2.3 ms with the table
    at the tokenizer's 4,096 (`scripts/bench_grammar.py --vocab-size 151936 --random-steps 150`).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        tokenizer_size = len(tokenizer)
        if vocab_size < tokenizer_size:
            raise GrammarError(
                f"vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer_size} tokens"
            )
        stops = tuple(dict.fromkeys(int(t) for t in stop_token_ids))
        if not stops:
            raise GrammarError("give at least one stop token id (e.g. <|im_end|>)")
        out_of_range = [t for t in stops if not 0 <= t < tokenizer_size]
        if out_of_range:
            raise GrammarError(f"stop token ids {out_of_range} are not in the tokenizer")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.tokenizer_size = tokenizer_size
        self.stop_token_ids = stops
        # the ids a bitmask row covers: the tokenizer's, to a whole word of 32 (at most the logits')
        self.mask_size = min(vocab_size, -(-tokenizer_size // BITS_PER_WORD) * BITS_PER_WORD)
        banned = _special_token_ids(tokenizer) - set(stops)
        self.info = _token_table(tokenizer, self.mask_size, stops, banned)
        # Ids no grammar allows: special tokens other than the stops, and vocabulary padding.
        self.never_allowed = frozenset(banned | set(range(tokenizer_size, vocab_size)))
        self._encode_cached = lru_cache(maxsize=ENCODE_CACHE_SIZE)(self._encode)

    def encode(self, text: str) -> tuple[int, ...]:
        """The canonical tokenisation of `text`, no special tokens added (memoised). Text that reads
        as a special token ("<|im_end|>" in a category) is tokenised as the ordinary text it is: no
        grammar allows a special id, so before, a forced span stopped there and the model spelled
        the rest itself, with more tokens than the answer's budget had counted."""
        return self._encode_cached(text)

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(ordinary_text_encoder(self.tokenizer)(text))

    def check_bitmask(self, bitmask: torch.Tensor) -> None:
        """A clear error unless `bitmask` is `[B, W]` int32 with W words for `mask_size` ids (what
        xgrammar fills; `apply_bitmask` disallows the logits' columns past them)."""
        words = -(-self.mask_size // BITS_PER_WORD)
        if bitmask.dim() != 2 or bitmask.shape[1] != words or bitmask.dtype != torch.int32:
            raise ValueError(
                f"a grammar bitmask is int32 [B, {words}] (the tokenizer's {self.mask_size} ids: "
                f"allocate_bitmask(B, vocabulary.mask_size)), got {bitmask.dtype} {list(bitmask.shape)}"
            )

    def is_matchable(self, token_id: int) -> bool:
        """False for ids no grammar can allow (checked first: xgrammar would log a warning)."""
        return 0 <= token_id < self.vocab_size and token_id not in self.never_allowed

    def describe_token(self, token_id: int) -> str:
        """`17 ('"category')`-style text for error messages."""
        if 0 <= token_id < self.tokenizer_size:
            kind = ", a special token" if token_id in self.never_allowed else ""
            return f"{token_id} ({self.tokenizer.decode([token_id])!r}{kind})"
        if self.tokenizer_size <= token_id < self.vocab_size:
            return f"{token_id} (vocabulary padding past the tokenizer's {self.tokenizer_size})"
        return f"{token_id} (outside the vocabulary of {self.vocab_size})"


def _token_table(
    tokenizer: Any, vocab_size: int, stops: tuple[int, ...], banned: set[int]
) -> xgr.TokenizerInfo:
    """xgrammar's token table, with the `banned` ids made unmatchable."""
    detected = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=list(stops)
    )
    encoded_vocab = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size and token_id not in banned:
            encoded_vocab[token_id] = token
    return xgr.TokenizerInfo(
        encoded_vocab,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=list(stops),
        add_prefix_space=detected.add_prefix_space,
    )


def _special_token_ids(tokenizer: Any) -> set[int]:
    special = set(tokenizer.all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special.update(token_id for token_id, token in added.items() if token.special)
    return special
