"""Look up an output schema by name, pydantic model or raw JSON schema.

Every consumer (constrained decoding, the service, the evaluation) calls
`resolve_schema` and gets one `OutputSchema`: a name, the JSON schema that
drives the grammar, and a validator for finished answers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import jsonschema
from pydantic import BaseModel, ValidationError

from schemas.product_metadata import ProductDetails, ProductMetadata

# Objects and arrays nested in one JSON schema, at most. Deeper schemas exhaust the recursion of
# meta-validation or grammar compilation (about 100 nested arrays did); real schemas nest a few.
MAX_SCHEMA_DEPTH = 64


class SchemaError(ValueError):
    """An output schema that cannot be used: unknown name or invalid JSON schema."""


class AnswerValidationError(ValueError):
    """A model answer that does not validate against its schema."""


@dataclass(frozen=True)
class OutputSchema:
    """A resolved output schema. `model` is set when it came from pydantic."""

    name: str
    json_schema: dict[str, Any] = field(hash=False)
    model: type[BaseModel] | None = None

    @property
    def schema_text(self) -> str:
        """Canonical text of the schema; equal schemas give equal text (cache key)."""
        return json.dumps(self.json_schema, sort_keys=True, separators=(",", ":"))

    def validate(self, text: str) -> Any:
        """Parse and validate an answer; raise `AnswerValidationError` naming the problem."""
        if self.model is not None:
            try:
                return self.model.model_validate_json(text)
            except ValidationError as exc:
                raise AnswerValidationError(str(exc)) from exc
        try:
            value = json.loads(text)
            jsonschema.validate(value, self.json_schema)
        except json.JSONDecodeError as exc:
            raise AnswerValidationError(f"not JSON: {exc}") from exc
        except jsonschema.ValidationError as exc:
            raise AnswerValidationError(exc.message) from exc
        except RecursionError:
            raise AnswerValidationError("the answer is nested too deeply to check") from None
        return value


_REGISTRY: dict[str, type[BaseModel]] = {
    "product_metadata": ProductMetadata,
    "product_details": ProductDetails,
}


def register_schema(name: str, model: type[BaseModel]) -> None:
    """Make `model` available by `name` (e.g. in REST requests)."""
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise SchemaError(f"schema {name!r} must be a pydantic model class, got {model!r}")
    _REGISTRY[name] = model


def schema_names() -> list[str]:
    return sorted(_REGISTRY)


def resolve_schema(schema: str | type[BaseModel] | dict[str, Any] | OutputSchema) -> OutputSchema:
    """Turn a registered name, a pydantic model class or a JSON-schema dict into an OutputSchema."""
    if isinstance(schema, OutputSchema):
        return schema
    if isinstance(schema, str):
        try:
            model = _REGISTRY[schema]
        except KeyError:
            if schema.lstrip().startswith("{"):  # JSON text where the schema itself was meant
                raise SchemaError(
                    "a string names a registered schema; give a JSON schema as a dict (json.loads the text)"
                ) from None
            raise SchemaError(
                f"unknown schema name {schema!r}; registered: {', '.join(schema_names())}"
            ) from None
        return OutputSchema(name=schema, json_schema=model.model_json_schema(), model=model)
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        return OutputSchema(name=schema.__name__, json_schema=schema.model_json_schema(), model=schema)
    if isinstance(schema, dict):
        if _nesting_exceeds(schema, MAX_SCHEMA_DEPTH):
            raise SchemaError(
                f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} JSON objects and arrays in one another "
                "(a nested property takes two: `properties` and its schema); flatten it, or name parts in $defs"
            )
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise SchemaError(f"invalid JSON schema: {exc.message}") from exc
        except RecursionError:  # a $ref cycle the meta-schema walks without end, say
            raise SchemaError("the JSON schema is nested too deeply to check") from None
        try:
            json.dumps(schema)
        except (TypeError, ValueError) as exc:
            raise SchemaError(f"JSON schema is not JSON-serialisable: {exc}") from exc
        return OutputSchema(name=str(schema.get("title", "json_schema")), json_schema=schema)
    raise SchemaError(
        "schema must be a registered name, a pydantic model class or a JSON-schema dict, "
        f"got {type(schema).__name__}"
    )


def _nesting_exceeds(value: Any, limit: int) -> bool:
    """Whether `value` nests dicts and lists more than `limit` deep (iterative: any depth, and a
    dict that contains itself, is answered without recursion)."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        pending.extend((child, depth + 1) for child in children)
    return False
