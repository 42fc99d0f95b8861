"""Per-record answer schemas: the category restricted to that record's candidates.

The benchmark asks the model to pick one of 8-9 candidate categories. With the
candidates as a JSON-schema `enum`, the grammar makes any other category (a
typo, a truncated path, an invented one) impossible, and once the prefix typed
so far matches a single candidate, the rest of the path is a forced span that
jump-forward decoding emits without model steps.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel

from schemas import OutputSchema, ProductMetadata, SchemaError, resolve_schema
from vlm_catalog.structured.errors import GrammarError

CATEGORY_FIELD = "category"


def catalogue_schema(
    candidates: Sequence[str],
    base: type[BaseModel] | dict[str, Any] | str = ProductMetadata,
) -> OutputSchema:
    """`base`'s schema with `category` restricted to an `enum` of `candidates`.

    Candidates are deduplicated in their given order. Everything else of the base
    schema (descriptions, titles, `additionalProperties: false`, property order)
    is kept. `base` is a pydantic model class, a JSON-schema dict or a registered
    schema name, and must have a `category` property.

    The result is an `OutputSchema` rather than a dict: `base` is checked once
    here, and adding a string `enum` keeps a valid schema valid, so the engine
    does not meta-validate the per-record schema again (that costs ~1.7 ms, a
    third of the grammar compile). It has no pydantic `model`, so
    `OutputSchema.validate` checks answers against the enum too.
    """
    options = _checked_candidates(candidates)
    try:
        resolved = resolve_schema(base)
        schema = copy.deepcopy(resolved.json_schema)
    except SchemaError as exc:
        raise GrammarError(f"catalogue_schema base: {exc}") from exc
    category = schema.get("properties", {}).get(CATEGORY_FIELD)
    if not isinstance(category, dict):
        raise GrammarError(
            f"catalogue_schema base {schema.get('title', 'schema')!r} has no "
            f"{CATEGORY_FIELD!r} property to restrict"
        )
    category["enum"] = options
    return OutputSchema(name=resolved.name, json_schema=schema)


def _checked_candidates(candidates: object) -> list[str]:
    if isinstance(candidates, str) or not isinstance(candidates, Sequence):
        raise GrammarError(
            f"candidate categories must be a list of strings, got {type(candidates).__name__}"
        )
    if not candidates:
        raise GrammarError("the candidate category list is empty: give at least one category")
    for position, candidate in enumerate(candidates):
        if not isinstance(candidate, str):
            raise GrammarError(
                f"candidate category at position {position} is a {type(candidate).__name__}, "
                "not a string"
            )
        if not candidate.strip():
            raise GrammarError(f"candidate category at position {position} is blank")
        try:  # JSON's "\ud800" escape reads as a lone surrogate: no UTF-8 form, no token
            candidate.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise GrammarError(f"candidate category at position {position} has an unpaired surrogate "
                               f"{candidate[exc.start]!r} at character {exc.start} (not valid Unicode)") from None
    return list(dict.fromkeys(candidates))


# --------------------------------------------------------------- token budget
# A JSON string character costs at most 4 tokens: the pattern below admits no
# escape sequences, so a character is its UTF-8 bytes (1-4) in the answer, and
# a byte-level BPE token holds at least one byte.
MAX_TOKENS_PER_FREE_CHAR = 4
# Tokens the fixed parts may take beyond their canonical tokenisation (where
# the model, not a forced span, chooses how to spell a category prefix).
RESERVE_SLACK_TOKENS = 4
# Raw characters only: no control characters, no `"` and no `\` (so no escapes), and
# Unicode scalar values only, listed (U+0020 to U+10FFFF less `"`, `\` and the
# surrogates): xgrammar's negated class [^"\\\x00-\x1f] also took the UTF-8-style bytes of a
# surrogate (ED A0 80) and an overlong form (E0 80 80), which decode to three U+FFFD each, so
# a finished brand broke its own length bound (xgrammar 0.1, the declared floor, still takes
# overlong forms in any class). The top of the range is the character itself: xgrammar's regex
# has no \U escape.
_FREE_TEXT_CHARACTERS = '[ !#-\\[\\]-\\ud7ff\\ue000-\U0010ffff]'


def token_counter(tokenizer: Any) -> Callable[[str], int]:
    """`count_tokens` for `record_schema`: the tokens an answer spells `text` with. Text that
    reads as a special token (a category "Home > <|im_end|>") counts as the ordinary text it is
    (`ordinary_text_encoder`), since no grammar lets a special id stand for it: counted as one
    token, "<|im_end|>" * 10 took 71, and the bounded schema's answer no longer fit its budget."""
    from vlm_catalog.structured.vocabulary import ordinary_text_encoder

    encode = ordinary_text_encoder(tokenizer)

    def count_tokens(text: str) -> int:
        return len(encode(text))

    return count_tokens


def answer_reserve(
    candidates: Sequence[str],
    count_tokens: Callable[[str], int],
    base: type[BaseModel] | dict[str, Any] | str = ProductMetadata,
) -> int:
    """Tokens an answer needs besides its free text: keys, punctuation, the longest
    candidate, the longest value of every other field (canonical tokens), plus
    `RESERVE_SLACK_TOKENS` for where the model, not a forced span, spells a
    category prefix."""
    schema = catalogue_schema(candidates, base)
    properties = schema.json_schema.get("properties", {})
    definitions = schema.json_schema.get("$defs", {})
    widest = {  # every property, optional ones too: the grammar may emit them
        name: _widest_value(name, _resolved(spec, definitions), count_tokens)
        for name, spec in properties.items()
    }
    return count_tokens(json.dumps(widest, separators=(",", ":"), ensure_ascii=False)) + RESERVE_SLACK_TOKENS


# A budget this close to an answer's fixed parts gets the bounded schema at once.
TIGHT_BUDGET_MARGIN_TOKENS = 32


def budget_is_tight(
    candidates: Sequence[str],
    max_tokens: int,
    count_tokens: Callable[[str], int],
    base: type[BaseModel] | dict[str, Any] | str = ProductMetadata,
    reserve: int | None = None,
) -> bool:
    """True when `max_tokens` leaves less than `TIGHT_BUDGET_MARGIN_TOKENS` beyond the
    answer's fixed parts: then the bounded schema is used from the start, not only
    to re-run an answer the budget cut. `reserve`: `answer_reserve`, if the caller has it."""
    if reserve is None:
        reserve = answer_reserve(candidates, count_tokens, base)
    return max_tokens < reserve + TIGHT_BUDGET_MARGIN_TOKENS


def budgeted_catalogue_schema(
    candidates: Sequence[str],
    max_tokens: int,
    count_tokens: Callable[[str], int],
    base: type[BaseModel] | dict[str, Any] | str = ProductMetadata,
    reserve: int | None = None,
) -> tuple[OutputSchema, int]:
    """The per-record schema whose every complete answer fits in the token budget.

    Returns the schema and the budget to run it with. The fixed parts of an
    answer are reserved (`answer_reserve`); what the budget leaves is shared
    by the free-text string fields (`brand`): each gets a `pattern` of at most
    `L` raw characters with
    `L = (max_tokens - reserve) // (fields * MAX_TOKENS_PER_FREE_CHAR)`.
    So the grammar ends every answer before the budget runs out, and a short
    `--max-tokens` yields a short brand, never a cut answer. When `max_tokens`
    is smaller than the reserve (no complete answer could fit), the budget
    returned is the reserve and the free-text fields must be empty.

    The bound costs compile time (xgrammar makes one state per allowed
    character: about 30 ms at L = 29 against 8 ms unbounded on the shipped
    model's vocabulary), so callers use it where it is needed: for a tight
    budget at once, otherwise only to re-run an answer the budget cut
    (`vlm_catalog.batch.requests`, `LLM.extract`).
    """
    if reserve is None:
        reserve = answer_reserve(candidates, count_tokens, base)
    schema = catalogue_schema(candidates, base)
    properties = schema.json_schema.get("properties", {})
    free_fields = [
        name for name, spec in properties.items()
        if name != CATEGORY_FIELD and _is_free_string(spec)
    ]
    budget = max(max_tokens, reserve)
    if free_fields:
        length = (budget - reserve) // (len(free_fields) * MAX_TOKENS_PER_FREE_CHAR)
        for name in free_fields:
            properties[name] = {
                **{key: value for key, value in properties[name].items() if key not in ("maxLength", "pattern")},
                "pattern": f"^{_FREE_TEXT_CHARACTERS}{{0,{length}}}$",
            }
    return schema, budget


def record_schema(
    candidates: Sequence[str],
    max_tokens: int,
    count_tokens: Callable[[str], int],
    base: type[BaseModel] | dict[str, Any] | str = ProductMetadata,
    bounded: bool = False,
    answer_room: int | None = None,
) -> tuple[OutputSchema, int, bool]:
    """The schema to run a record with: `(schema, max_tokens to run it with, bounded)`.

    The bounded schema (`budgeted_catalogue_schema`) when asked for (to re-run an
    answer the budget cut) or when the budget is tight (`budget_is_tight`); the
    plain per-record schema otherwise, which is cheaper to compile.

    `answer_room`: the tokens the model's context leaves after the record's
    prompt (`LLMEngine.answer_room`). The engine ends every answer there, so the
    budget is the smaller of `max_tokens` and the room, and the bounded schema's
    guarantee (a complete answer within the budget) holds against the context
    too. A room below the answer's fixed parts (`answer_reserve`) allows no
    guarantee: the record runs with all the room (even beyond `max_tokens`) and
    the plain schema first, since the answer the model picks may still fit; a
    re-run gets the bounded one, whose free text is empty.
    """
    reserve = answer_reserve(candidates, count_tokens, base)  # once: it tokenises the widest answer
    if answer_room is not None:
        if answer_room < reserve:  # all the room, whatever max_tokens
            if bounded:
                schema, _ = budgeted_catalogue_schema(candidates, answer_room, count_tokens, base, reserve)
                return schema, answer_room, True
            return catalogue_schema(candidates, base), answer_room, False
        max_tokens = min(max_tokens, answer_room)
    if bounded or budget_is_tight(candidates, max_tokens, count_tokens, base, reserve):
        schema, budget = budgeted_catalogue_schema(candidates, max_tokens, count_tokens, base, reserve)
        return schema, budget, True
    return catalogue_schema(candidates, base), max_tokens, False


def _is_free_string(spec: Any) -> bool:
    return isinstance(spec, dict) and spec.get("type") == "string" and "enum" not in spec and "$ref" not in spec


def _resolved(spec: Any, definitions: dict[str, Any]) -> Any:
    """`spec` with a local `#/$defs/Name` reference replaced by its definition."""
    if isinstance(spec, dict) and isinstance(spec.get("$ref"), str) and spec["$ref"].startswith("#/$defs/"):
        return {**definitions.get(spec["$ref"][len("#/$defs/"):], {}), **{k: v for k, v in spec.items() if k != "$ref"}}
    return spec


def _widest_value(name: str, spec: Any, count_tokens: Callable[[str], int]) -> Any:
    """The value of a field whose answer text takes the most tokens (free text: empty)."""
    if not isinstance(spec, dict):
        raise GrammarError(f"cannot budget field {name!r}: its schema is not an object")
    options = spec.get("enum")
    if options is not None:
        return max(options, key=lambda option: count_tokens(json.dumps(option, ensure_ascii=False)))
    kind = spec.get("type")
    if kind == "string":
        return ""
    if kind == "boolean":
        return False
    raise GrammarError(f"cannot budget field {name!r} of type {kind!r}")
