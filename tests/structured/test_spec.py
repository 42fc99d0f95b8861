"""GrammarSpec: one of schema / regex / choice, validated, usable as a cache key."""

from __future__ import annotations

import json

import pytest

from schemas import ProductMetadata, resolve_schema
from vlm_catalog.structured import GrammarError, GrammarSpec


def test_schema_given_by_name_model_dict_or_output_schema_is_one_key():
    specs = [
        GrammarSpec.from_request(json_schema="product_metadata"),
        GrammarSpec.from_request(json_schema=ProductMetadata),
        GrammarSpec.from_request(json_schema=ProductMetadata.model_json_schema()),
        GrammarSpec.from_request(json_schema=resolve_schema(ProductMetadata)),
    ]
    assert len(set(specs)) == 1
    assert all(spec.kind == "json_schema" for spec in specs)
    assert specs[0].output_schema.model is ProductMetadata


def test_schema_text_keeps_property_order():
    spec = GrammarSpec.from_request(json_schema=ProductMetadata)
    properties = list(json.loads(spec.json_schema)["properties"])
    assert properties == ["category", "brand", "is_secondhand"]
    assert spec.json_schema == json.dumps(
        ProductMetadata.model_json_schema(), separators=(",", ":"), ensure_ascii=False
    )


def test_regex_and_choice_specs():
    regex = GrammarSpec.from_request(regex=r"\d{3}")
    assert (regex.kind, regex.regex) == ("regex", r"\d{3}")
    choice = GrammarSpec.from_request(choice=["new", "used", "new"])
    assert (choice.kind, choice.choice) == ("choice", ("new", "used"))
    assert choice == GrammarSpec.from_request(choice=("new", "used"))
    assert choice != GrammarSpec.from_request(choice=["used", "new"])
    assert regex != GrammarSpec.from_request(regex=r"\d{4}")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({}, "exactly one of json_schema, regex or choice; got none"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
        ({"json_schema": ProductMetadata, "regex": "a"}, "got json_schema, regex"),
        ({"choice": []}, "choice is empty"),
        ({"choice": "yes"}, "choice must be a list of strings, got str"),
        ({"choice": ["yes", 3]}, r"choice\[1\] must be a string, got int"),
        ({"choice": ["yes", ""]}, r"choice\[1\] is an empty string"),
        ({"regex": ""}, "regex is empty"),
        ({"regex": 5}, "regex must be a string, got int"),
        ({"json_schema": "no_such_schema"}, "unknown schema name 'no_such_schema'"),
        ({"json_schema": {"type": 5}}, "invalid JSON schema"),
        ({"json_schema": 3.5}, "got float"),
        # Python's json.loads reads NaN/Infinity, so a request body can carry them
        ({"json_schema": {"type": "number", "maximum": float("nan")}}, "holds NaN or Infinity"),
        ({"json_schema": {"enum": [float("inf"), 1]}}, "holds NaN or Infinity"),
    ],
)
def test_invalid_requests_name_the_problem(arguments, message):
    with pytest.raises(GrammarError, match=message):
        GrammarSpec.from_request(**arguments)


def test_direct_construction_checks_exactly_one():
    with pytest.raises(GrammarError, match="exactly one"):
        GrammarSpec(regex="a", choice=("a",))
    with pytest.raises(GrammarError, match="tuple"):
        GrammarSpec(choice=["a"])


def test_grammar_error_is_a_value_error():
    assert issubclass(GrammarError, ValueError)
