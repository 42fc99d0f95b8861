"""Per-record schemas: the category can only be one of the record's candidates."""

from __future__ import annotations

import pytest

from schemas import ProductDetails, ProductMetadata
from vlm_catalog.structured import GrammarError, GrammarSpec, GrammarState, catalogue_schema

CANDIDATES = [
    "Home & Garden > Lighting > Lamps",
    "Home & Garden > Lighting > Lamp Shades",
    "Home & Garden > Decor > Clocks",
    "Home & Garden > Lighting > Lamps",
]


def test_category_becomes_enum_rest_kept():
    schema = catalogue_schema(CANDIDATES)
    base = ProductMetadata.model_json_schema()
    category = schema["properties"]["category"]
    assert category["enum"] == CANDIDATES[:3]  # deduplicated, order kept
    assert {k: v for k, v in category.items() if k != "enum"} == base["properties"]["category"]
    assert {k: v for k, v in schema.items() if k != "properties"} == {
        k: v for k, v in base.items() if k != "properties"
    }
    assert schema["additionalProperties"] is False
    assert list(schema["properties"]) == list(base["properties"])
    assert "enum" not in ProductMetadata.model_json_schema()["properties"]["category"]


def test_product_details_base_keeps_its_definitions():
    schema = catalogue_schema(CANDIDATES, base=ProductDetails)
    assert schema["properties"]["category"]["enum"] == CANDIDATES[:3]
    assert schema["$defs"] == ProductDetails.model_json_schema()["$defs"]


@pytest.mark.parametrize(
    ("candidates", "message"),
    [
        ([], "candidate category list is empty"),
        ("Home & Garden", "must be a list of strings, got str"),
        (["Home & Garden", " "], "position 1 is blank"),
        (["Home & Garden", None], "position 1 is a NoneType"),
    ],
)
def test_bad_candidate_lists(candidates, message):
    with pytest.raises(GrammarError, match=message):
        catalogue_schema(candidates)


def test_base_without_category():
    with pytest.raises(GrammarError, match="no 'category' property"):
        catalogue_schema(
            CANDIDATES, base={"type": "object", "properties": {"brand": {"type": "string"}}}
        )


def answer(category: str) -> str:
    return '{"category":"' + category + '","brand":"Lumo","is_secondhand":false}'


def test_grammar_admits_only_candidates(service, tokenizer):
    compiled = service.compile(GrammarSpec.from_request(json_schema=catalogue_schema(CANDIDATES)))
    state = GrammarState(compiled)
    state.accept(tokenizer.encode(answer(CANDIDATES[1]), add_special_tokens=False))
    assert state.is_finished()
    wrong_categories = [
        "Home & Garden > Lighting",  # a prefix of a candidate
        "Home & Garden > Lighting > Lamps > Desk Lamps",  # a candidate extended
        "Toys",  # invented
    ]
    for wrong in wrong_categories:
        tokens = tokenizer.encode(answer(wrong), add_special_tokens=False)
        with pytest.raises(GrammarError, match="not allowed"):
            GrammarState(compiled).accept(tokens)
