"""Constrained decoding with xgrammar: JSON schemas, regexes, choices, jump-forward.

The engine's view, one request's life:

1. `spec = GrammarSpec.from_request(json_schema=..., regex=..., choice=...)`
   (a bad request raises `GrammarError` here);
   for the benchmark, `json_schema=catalogue_schema(record.candidate_categories)`.
2. `future = service.submit(spec)` on a `GrammarCompilerService`; the request is
   scheduled once the future is done (`GrammarError` if it cannot compile).
3. `state = GrammarState(future.result())`.
4. Each step: `filler.fill(states, rows, bitmask, force_canonical=True)` (a
   `BitmaskFiller`: every grammar row at once, in parallel threads; one row alone
   is `state.fill_bitmask(bitmask, row, ...)`) on a bitmask from
   `allocate_bitmask`, then
   `apply_bitmask(logits, bitmask, rows)`, sample, `state.accept([token])`.
   With jump-forward on, first append and `accept` `state.forced_tokens()`.
   `state.is_finished()` ends the request without spending a step on EOS.

`vlm_catalog.structured.state` documents the forced-span contract that makes
jump-forward on and off produce identical tokens.
"""

from vlm_catalog.structured.bitmask import BitmaskBuffer, allocate_bitmask, apply_bitmask
from vlm_catalog.structured.catalogue import catalogue_schema
from vlm_catalog.structured.compiler import (
    CompiledGrammar,
    CompilerStats,
    GrammarCompilerService,
    choice_ebnf,
)
from vlm_catalog.structured.errors import GrammarError
from vlm_catalog.structured.spec import GrammarKind, GrammarSpec
from vlm_catalog.structured.state import BitmaskFiller, GrammarState
from vlm_catalog.structured.vocabulary import GrammarVocabulary

__all__ = [
    "CompiledGrammar",
    "CompilerStats",
    "GrammarCompilerService",
    "GrammarError",
    "GrammarKind",
    "GrammarSpec",
    "GrammarState",
    "GrammarVocabulary",
    "BitmaskBuffer",
    "BitmaskFiller",
    "allocate_bitmask",
    "apply_bitmask",
    "catalogue_schema",
    "choice_ebnf",
]
