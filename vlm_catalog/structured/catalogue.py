"""Per-record answer schemas: the category restricted to that record's candidates.

The benchmark asks the model to pick one of 8-9 candidate categories. With the
candidates as a JSON-schema `enum`, the grammar makes any other category (a
typo, a truncated path, an invented one) impossible, and once the prefix typed
so far matches a single candidate, the rest of the path is a forced span that
jump-forward decoding emits without model steps.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
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
    return list(dict.fromkeys(candidates))
