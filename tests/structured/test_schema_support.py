"""check_enforceable: schemas the grammar cannot keep answers to are refused, naming why and where;
the schemas it enforces (the shipped ones, and the usual JSON-schema vocabulary) pass."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from schemas import ProductDetails, ProductMetadata
from vlm_catalog.structured import GrammarError, GrammarSpec, GrammarState, catalogue_schema


def obj(**properties) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


ENFORCED = {
    "enum and const": obj(colour={"enum": ["red", "green"]}, kind={"const": "shirt", "type": "string"}),
    "bounds": obj(i={"type": "integer", "minimum": -5, "exclusiveMaximum": 17, "multipleOf": 3},
                  s={"type": "string", "minLength": 1, "maxLength": 8}, tags={"type": "array", "maxItems": 3}),
    "pattern": obj(sku={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"}, path={"type": "string", "pattern": r"C:\\build"}),
    "anyOf, type lists": obj(v={"anyOf": [{"type": "string"}, {"type": "null"}]}, w={"type": ["integer", "null"]}),
    "oneOf of other types": obj(v={"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}),
    "a tree that ends": {"$defs": {"node": obj(v={"type": "integer"}, kids={"type": "array", "items": {"$ref": "#/$defs/node"}})},
                         "$ref": "#/$defs/node"},
    "a $ref with a description": {"$defs": {"p": {"type": "integer"}}, **obj(p={"$ref": "#/$defs/p", "description": "price"})},
    "anything": {},
    "one allOf": {"allOf": [obj(a={"type": "integer"})]},
    "closed and empty": {"type": "object", "additionalProperties": False},
    "format (an annotation)": obj(day={"type": "string", "format": "date"}),
}


@pytest.mark.parametrize("schema", list(ENFORCED.values()), ids=list(ENFORCED))
def test_schemas_the_grammar_enforces_pass(schema):
    assert GrammarSpec.from_request(json_schema=schema).json_schema is not None


def test_the_shipped_and_pydantic_schemas_pass():
    class Cat(BaseModel):
        pet_type: Literal["cat"]
        meows: int

    class Dog(BaseModel):
        pet_type: Literal["dog"]
        barks: float

    class Owner(BaseModel):  # a discriminated union: pydantic writes a oneOf whose branches a const tells apart
        pet: Cat | Dog = Field(discriminator="pet_type")
        tags: list[str] = []

    for schema in (ProductMetadata, ProductDetails, "product_metadata", "product_details", Owner,
                   catalogue_schema(["A > B", "C > D"])):
        GrammarSpec.from_request(json_schema=schema)


REFUSED = [
    (obj(u={"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True}),
     "at '/properties/u': 'uniqueItems' is not supported"),
    ({"type": "array", "contains": {"const": 5}}, "at its root: 'contains' is not supported"),
    ({"allOf": [obj(a={"type": "integer"}), obj(b={"type": "string"})]}, "'allOf' of 2 schemas is not supported"),
    (obj(v={"oneOf": [{"type": "integer"}, {"type": "number"}]}), "at '/properties/v': 'oneOf' whose branches may overlap"),
    (obj(v={"oneOf": [obj(a={"type": "integer"}), obj(b={"type": "integer"})]}), "'oneOf' whose branches may overlap"),
    ({**obj(a={"type": "integer"}, b={"type": "integer"}), "dependentRequired": {"a": ["b"]}}, "'dependentRequired'"),
    ({**obj(a={"type": "integer"}), "dependencies": {"a": ["b"]}}, "'dependencies' is not supported"),
    ({**obj(a={"type": "boolean"}), "if": {}, "then": {}}, "'if' is not supported"),
    (obj(a={"not": {"type": "boolean"}}), "at '/properties/a': 'not' is not supported"),
    ({"type": "integer", "const": "x"}, "the value 'x' is not of type integer"),
    ({"type": "string", "enum": ["a", 1]}, "the value 1 is not of type string"),
    ({"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False},
     "the required property 'a' is not in 'properties'"),
    (obj(s={"type": "string", "pattern": "^(?!ab)[ab]{2}$"}), "the pattern's '(?!' is not supported"),
    (obj(s={"type": "string", "pattern": r"\bword"}), r"the pattern's '\b' is not supported"),
    (obj(s={"type": "string", "pattern": "[a-z]+", "maxLength": 3}), "'minLength'/'maxLength' beside a 'pattern'"),
    ({"$defs": {"s": {"type": "string"}}, **obj(a={"$ref": "#/$defs/s", "maxLength": 2})},
     "at '/properties/a': 'maxLength' beside a '$ref' is not supported"),
    (obj(a={"$ref": "http://example.invalid/s.json"}), "$ref 'http://example.invalid/s.json' is not supported"),
    (obj(a={"$ref": "#/$defs/missing"}), "$ref '#/$defs/missing' names nothing in the schema"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"], "additionalProperties": False},
     "at its root: no finite JSON value matches it"),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "at its root: no finite JSON value matches it"),
    ({"$defs": {"loop": {"$ref": "#/$defs/loop"}}, **obj(a={"$ref": "#/$defs/loop"})}, "no finite JSON value matches it"),
]


@pytest.mark.parametrize(("schema", "message"), REFUSED, ids=[message[:40] for _, message in REFUSED])
def test_schemas_the_grammar_cannot_keep_are_refused_naming_why(schema, message):
    with pytest.raises(GrammarError) as refused:
        GrammarSpec.from_request(json_schema=schema)
    assert message in str(refused.value)


def test_why_the_keywords_are_refused_the_grammar_drops_them(service, tokenizer):
    """Compiled as it is (past the check), uniqueItems lets an answer repeat an item and end: the
    answers that ended "stop" and failed their schema (16 of 18 in the audit)."""
    schema = obj(u={"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 2, "maxItems": 3, "uniqueItems": True})
    unchecked = GrammarSpec(json_schema=json.dumps(schema, separators=(",", ":")))
    state = GrammarState(service.compile(unchecked))
    state.accept(tokenizer.encode('{"u":[3,3]}', add_special_tokens=False))
    assert state.is_finished()


def test_a_schema_with_no_finite_answer_reaches_no_compiler(make_service):
    """Before, the grammar forced an endless string and finding it took every byte of memory
    (std::bad_alloc, failing every request in flight)."""
    service = make_service()
    with pytest.raises(GrammarError, match="no finite JSON value"):
        service.submit(GrammarSpec.from_request(json_schema={"type": "array", "items": {"$ref": "#"}, "minItems": 1}))
    assert service.stats().misses == 0


@pytest.mark.parametrize(("brand", "allowed"), [
    (r"\ud800", False), (r"\udc00x", False), (r"\ud83d\ude00", True), (r"\u00e9\uDBFF\uDFFF", True), (r"\u0041", True)])
def test_a_string_escape_is_never_a_lone_surrogate(service, tokenizer, brand, allowed):
    """JSON lets "\\ud800" through, pydantic does not (ProductMetadata refused such an answer the
    grammar called finished); surrogates are allowed in pairs only."""
    answer = '{"category":"A > B","brand":"' + brand + '","is_secondhand":false}'
    state = GrammarState(service.compile(GrammarSpec.from_request(json_schema=ProductMetadata)))
    if not allowed:
        with pytest.raises(GrammarError):
            state.accept(tokenizer.encode(answer, add_special_tokens=False))
        return
    state.accept(tokenizer.encode(answer, add_special_tokens=False))
    assert state.is_finished() and ProductMetadata.model_validate_json(answer).brand
