"""`GrammarState`: one request's grammar matcher, with forced spans for jump-forward.

Masking
    Every decode step the engine fills each constrained request's row, all rows at
    once through `BitmaskFiller` (the same rows `fill_bitmask(bitmask, row)` writes
    one at a time); the row then allows exactly the tokens the grammar accepts next
    (padding ids past the tokenizer and special tokens other than the stop tokens
    are never allowed). After sampling it calls `accept([token])`.

Forced spans: the contract
    Often the grammar admits a single continuation string `s` (xgrammar's
    `find_jump_forward_string()`): JSON keys and punctuation such as
    `","brand":"`, the rest of a category path once the prefix typed so far
    matches a single candidate of the enum, `rue}` after `t` in a boolean.
    `forced_tokens()` returns the *canonical* tokenisation of `s`
    (`Vocabulary.encode`: special-token text as ordinary text):

    - without its last token: the model chooses that boundary token itself,
      because the canonical tokenisation of the whole answer may merge the end
      of `s` with what follows (so a forced string of one token forces nothing);
    - truncated to the longest prefix the matcher accepts (checked by accepting
      and rolling back): it never returns a token the grammar would reject.

    Once computed at a position, the forced tokens are a *plan*: accepting its
    first token leaves the rest of the plan (the plan is not recomputed
    mid-span, since the tokenisation of a suffix of `s` need not be the suffix
    of the tokenisation of `s`), and the token after a completed plan is always a
    free model choice. Accepting any token other than the plan's next one drops
    the plan. `rollback` restores the plan exactly as it was.

    The engine uses the plan in BOTH modes, so that jump-forward on and off
    produce identical tokens and text by construction:

    - jump-forward ON: append `forced_tokens()` to the request without model
      steps, `accept()` them, and let the next model step process them all as
      an extend; that step samples the boundary token.
    - jump-forward OFF: one model step per token, but fill the mask with
      `fill_bitmask(bitmask, row, force_canonical=True)`, which allows only
      `forced_tokens()[0]` while a plan is pending.

    Plain xgrammar masking is not enough for "off": it allows *every*
    tokenisation of a forced string (`"`, `category` or `"c`, `ategory`, ...),
    so the model could spell it differently from what jump-forward appends, and
    the two modes would diverge. Passing `force_canonical=True` in ON mode too is
    harmless: after the engine accepted the plan, nothing is pending.

    Identity holds for greedy decoding, and for sampling whose randomness is a
    function of the request and position; a per-request random stream advanced
    once per model step draws differently in OFF mode, whose forced steps
    consume draws too.

Finishing
    `is_finished()` is true once the grammar has accepted a stop token, or when
    nothing but a stop token can follow (the answer is complete; the engine may
    finish the request without spending a step on EOS).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import index

import torch
import xgrammar as xgr

from vlm_catalog.structured.bitmask import (
    allocate_bitmask,
    allow_only_token,
    allow_only_tokens,
    row_allows_only,
    row_token_ids,
)
from vlm_catalog.structured.compiler import CompiledGrammar
from vlm_catalog.structured.errors import GrammarError
from vlm_catalog.structured.spec import GrammarSpec

Plan = tuple[int, ...] | None  # forced tokens pending at this position; None = not computed yet


class GrammarState:
    """The grammar progress of one request. Not thread-safe: one engine thread owns it."""

    def __init__(self, compiled: CompiledGrammar) -> None:
        self.spec: GrammarSpec = compiled.spec
        self._vocabulary = compiled.vocabulary
        self._matcher = xgr.GrammarMatcher(compiled.grammar)
        self._plan: Plan = None
        self._plans_before: list[Plan] = []  # the plan before each accepted token, for rollback
        self._scratch = allocate_bitmask(1, self._vocabulary.mask_size)

    @property
    def mask_size(self) -> int:
        """The ids a bitmask row for this grammar covers (`GrammarVocabulary.mask_size`)."""
        return self._vocabulary.mask_size

    @property
    def num_accepted(self) -> int:
        """Tokens accepted so far (the request's output length under this grammar)."""
        return len(self._plans_before)

    # -- advancing ------------------------------------------------------------------------

    def accept(self, token_ids: Iterable[int]) -> None:
        """Advance over `token_ids`; all or nothing.

        Raises `GrammarError` naming the first token the grammar does not allow;
        the state is then unchanged.
        """
        accepted = 0
        for token in token_ids:
            token_id = index(token)
            if not self._advance_matcher(token_id):
                self.rollback(accepted)
                raise GrammarError(
                    f"token {self._vocabulary.describe_token(token_id)} is not allowed by the "
                    f"{self.spec.describe()} grammar after {self.num_accepted} tokens"
                )
            self._plans_before.append(self._plan)
            plan = self._plan
            self._plan = plan[1:] if plan and plan[0] == token_id else None
            accepted += 1

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (forced-span plan included)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise GrammarError(
                f"cannot roll back {num_tokens} tokens: {self.num_accepted} were accepted"
            )
        if num_tokens == 0:
            return
        self._matcher.rollback(num_tokens)
        self._plan = self._plans_before[-num_tokens]
        del self._plans_before[-num_tokens:]

    def _advance_matcher(self, token_id: int) -> bool:
        """Feed one token to the matcher; False (matcher unchanged) if not allowed."""
        return self._vocabulary.is_matchable(token_id) and self._matcher.accept_token(token_id)

    # -- forced spans ---------------------------------------------------------------------

    def forced_tokens(self) -> list[int]:
        """The canonical tokens the grammar forces next, boundary token excluded.

        See the module docstring for the contract both jump-forward modes rely on.
        """
        if self._plan is None:
            self._plan = () if self._matcher.is_terminated() else self._plan_forced_span()
        return list(self._plan)

    def _plan_forced_span(self) -> tuple[int, ...]:
        try:
            forced_text = self._matcher.find_jump_forward_string()
        except UnicodeDecodeError:
            # The matcher sits inside a multi-byte character (a byte-level token
            # ended mid-character): the forced bytes are not text; force nothing.
            return ()
        if not forced_text:
            return ()
        candidates = self._vocabulary.encode(forced_text)[:-1]
        accepted = 0
        for token_id in candidates:
            if not self._advance_matcher(token_id):
                break
            accepted += 1
        if accepted:
            self._matcher.rollback(accepted)
        return candidates[:accepted]

    # -- masks ----------------------------------------------------------------------------

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, force_canonical: bool = False) -> None:
        """Write the allowed next tokens into `bitmask[row]`.

        With `force_canonical=True` a pending forced span allows only its next
        token (jump-forward OFF; see the module doc). Do not fill for a state
        whose grammar has terminated.
        """
        self._vocabulary.check_bitmask(bitmask)
        source = self._next_token_source(force_canonical)
        if isinstance(source, int):
            allow_only_token(bitmask, row, source)
        else:
            source.fill_next_token_bitmask(bitmask, row)

    def _next_token_source(self, force_canonical: bool) -> int | xgr.GrammarMatcher:
        """What decides the next token's mask: the one token a forced span allows (with
        `force_canonical`), else the matcher, whose mask allows every token the grammar does."""
        if self._matcher.is_terminated():
            raise GrammarError(
                f"the {self.spec.describe()} grammar has terminated; no next token to mask"
            )
        if force_canonical:
            forced = self.forced_tokens()
            if forced:
                return forced[0]
        return self._matcher

    def allowed_token_ids(self) -> list[int]:
        """Every token the grammar allows next (tests and debugging; slow on big vocabularies)."""
        if self._matcher.is_terminated():
            return []
        self._matcher.fill_next_token_bitmask(self._scratch, 0)
        return row_token_ids(self._scratch[0], self._vocabulary.mask_size)

    # -- ending ---------------------------------------------------------------------------

    def is_terminated(self) -> bool:
        """True once a stop token has been accepted."""
        return self._matcher.is_terminated()

    def is_finished(self) -> bool:
        """True if terminated, or if nothing but a stop token can follow."""
        if self._matcher.is_terminated():
            return True
        if not self._matcher.is_completed():
            return False
        self._matcher.fill_next_token_bitmask(self._scratch, 0)
        return row_allows_only(self._scratch[0], self._vocabulary.stop_token_ids)


class BitmaskFiller:
    """Fills the rows of many grammar states in one call, xgrammar's matchers in parallel
    threads (`xgr.BatchGrammarMatcher`): a batch of 256 constrained requests costs about
    one row's time per thread, not 256. Each row gets exactly what
    `GrammarState.fill_bitmask` would write.
    """

    def __init__(self, max_threads: int | str = "auto") -> None:
        self._batch = xgr.BatchGrammarMatcher(max_threads)

    def fill(
        self,
        states: Sequence[GrammarState],
        rows: Sequence[int],
        bitmask: torch.Tensor,
        force_canonical: bool = False,
    ) -> None:
        """Write `states[i]`'s allowed next tokens into `bitmask[rows[i]]` for every i."""
        if len(states) != len(rows):
            raise ValueError(f"{len(states)} grammar states for {len(rows)} rows")
        if states:  # one engine's states share one vocabulary
            states[0]._vocabulary.check_bitmask(bitmask)
        matchers: list[xgr.GrammarMatcher] = []
        matcher_rows: list[int] = []
        forced_rows: list[int] = []
        forced_tokens: list[int] = []
        for state, row in zip(states, rows):
            source = state._next_token_source(force_canonical)
            if isinstance(source, int):
                forced_rows.append(int(row))
                forced_tokens.append(source)
            else:
                matchers.append(source)
                matcher_rows.append(int(row))
        allow_only_tokens(bitmask, forced_rows, forced_tokens)  # in two tensor ops, not two per row
        if matchers:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, matcher_rows)
