"""`GrammarSpec`: what one request asks its output to match.

A spec is exactly one of a JSON schema, a regular expression or a choice among
fixed strings. It is frozen and hashable, so the compiler service uses it as
its cache key.

The JSON schema is stored as text: `json.dumps` of the resolved schema, compact,
with the keys in their original order. Key order is deliberately kept (unlike
`OutputSchema.schema_text`, which sorts keys): xgrammar emits object properties
in the order the schema lists them, so sorting would turn `{"category", "brand",
"is_secondhand"}` into `{"brand", "category", "is_secondhand"}`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from schemas import OutputSchema, SchemaError, resolve_schema
from vlm_catalog.structured.errors import GrammarError
from vlm_catalog.structured.schema_support import check_enforceable

GrammarKind = Literal["json_schema", "regex", "choice"]

SchemaLike = str | type[BaseModel] | dict[str, Any] | OutputSchema


@dataclass(frozen=True)
class GrammarSpec:
    """Exactly one of `json_schema` (schema text), `regex` or `choice` is set.

    `output_schema` travels along for validating finished answers; it takes no
    part in equality or hashing (two specs with the same schema text share one
    compiled grammar). Build specs with `from_request`, which resolves and checks
    the request's arguments.
    """

    json_schema: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    output_schema: OutputSchema | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        names = ("json_schema", "regex", "choice")
        given = [name for name in names if getattr(self, name) is not None]
        if len(given) != 1:
            raise GrammarError(
                "a grammar spec needs exactly one of json_schema, regex or choice; "
                f"got {', '.join(given) if given else 'none'}"
            )
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            raise GrammarError("GrammarSpec.json_schema must be the schema's JSON text")
        if self.choice is not None and not isinstance(self.choice, tuple):
            raise GrammarError("GrammarSpec.choice must be a tuple of strings")

    @property
    def kind(self) -> GrammarKind:
        if self.json_schema is not None:
            return "json_schema"
        return "regex" if self.regex is not None else "choice"

    def describe(self) -> str:
        """A short human-readable name for logs and error messages."""
        if self.json_schema is not None:
            name = self.output_schema.name if self.output_schema is not None else "inline"
            return f"json_schema {name!r}"
        if self.regex is not None:
            return f"regex {_shorten(self.regex)!r}"
        return f"choice of {len(self.choice or ())} strings"

    @classmethod
    def from_request(
        cls,
        json_schema: SchemaLike | None = None,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
    ) -> GrammarSpec:
        """Validate a request's grammar arguments; raise `GrammarError` naming the problem.

        `json_schema` is a registered schema name, a pydantic model class, a
        JSON-schema dict or an `OutputSchema` (see `schemas.resolve_schema`).
        `choice` is a non-empty list of non-empty strings; duplicates are dropped,
        order kept.
        """
        given = [
            name
            for name, value in (("json_schema", json_schema), ("regex", regex), ("choice", choice))
            if value is not None
        ]
        if len(given) != 1:
            raise GrammarError(
                "give exactly one of json_schema, regex or choice; "
                f"got {', '.join(given) if given else 'none'}"
            )
        if json_schema is not None:
            return cls._for_json_schema(json_schema)
        if regex is not None:
            return cls(regex=_checked_regex(regex))
        return cls(choice=_checked_choice(choice))

    @classmethod
    def _for_json_schema(cls, schema: SchemaLike) -> GrammarSpec:
        try:
            resolved = resolve_schema(schema)
        except SchemaError as exc:
            raise GrammarError(f"json_schema: {exc}") from exc
        if not isinstance(schema, OutputSchema):  # one already resolved was checked then, or is ours (catalogue)
            check_enforceable(resolved.json_schema)  # keywords the grammar would drop, answers that could not end
        try:
            text = json.dumps(resolved.json_schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except ValueError:  # Python's json reads NaN and Infinity; JSON (and the grammar compiler) has neither
            raise GrammarError("json_schema: holds NaN or Infinity, which JSON does not allow") from None
        return cls(json_schema=text, output_schema=resolved)


def _checked_regex(regex: object) -> str:
    if not isinstance(regex, str):
        raise GrammarError(f"regex must be a string, got {type(regex).__name__}")
    if not regex:
        raise GrammarError("regex is empty")
    return regex


def _checked_choice(choice: object) -> tuple[str, ...]:
    if isinstance(choice, str) or not isinstance(choice, Sequence):
        raise GrammarError(f"choice must be a list of strings, got {type(choice).__name__}")
    if not choice:
        raise GrammarError("choice is empty: give at least one string")
    for position, option in enumerate(choice):
        if not isinstance(option, str):
            raise GrammarError(
                f"choice[{position}] must be a string, got {type(option).__name__}"
            )
        if not option:
            raise GrammarError(f"choice[{position}] is an empty string")
    return tuple(dict.fromkeys(choice))


def _shorten(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
