"""Output schemas: ProductMetadata as the benchmark defines it, the registry, records."""

import json

import pytest
from pydantic import BaseModel, ValidationError

from schemas import (
    AnswerValidationError,
    ProductDetails,
    ProductMetadata,
    ProductRecord,
    SchemaError,
    register_schema,
    resolve_schema,
)


def test_product_metadata_fields_are_required_and_closed():
    assert list(ProductMetadata.model_fields) == ["category", "brand", "is_secondhand"]
    ok = ProductMetadata.model_validate_json('{"category": "A > B", "brand": "x", "is_secondhand": false}')
    assert ok.is_secondhand is False
    for bad in ('{"category": "A", "brand": "x"}', '{"category": "A", "brand": "x", "is_secondhand": true, "extra": 1}'):
        with pytest.raises(ValidationError):
            ProductMetadata.model_validate_json(bad)
    schema = ProductMetadata.model_json_schema()
    assert schema["additionalProperties"] is False
    assert schema["required"] == ["category", "brand", "is_secondhand"]


def test_product_details_extends_the_benchmark_fields():
    assert set(ProductMetadata.model_fields) < set(ProductDetails.model_fields)
    details = ProductDetails(category="A", brand="b", is_secondhand=True, colour="red", material="wool",
                             target_gender="female", age_group="all ages", condition="used")
    assert json.loads(details.model_dump_json())["age_group"] == "all ages"
    with pytest.raises(ValidationError):
        ProductDetails(category="A", brand="b", is_secondhand=True, colour="chartreuse", material="wool",
                       target_gender="female", age_group="adult", condition="used")


def test_registry_resolves_names_models_and_dicts():
    by_name = resolve_schema("product_metadata")
    assert by_name.model is ProductMetadata and by_name.name == "product_metadata"
    assert resolve_schema(ProductMetadata).schema_text == by_name.schema_text

    class Colourful(BaseModel):
        colour: str

    register_schema("colourful", Colourful)
    assert resolve_schema("colourful").model is Colourful
    raw = resolve_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    assert raw.model is None
    assert raw.validate('{"n": 3}') == {"n": 3}
    with pytest.raises(AnswerValidationError, match="'n' is a required property"):
        raw.validate("{}")
    with pytest.raises(AnswerValidationError, match="not JSON"):
        raw.validate("{")
    with pytest.raises(AnswerValidationError):
        by_name.validate('{"category": 1}')


def test_registry_errors_name_the_problem():
    with pytest.raises(SchemaError, match="unknown schema name 'nope'"):
        resolve_schema("nope")
    with pytest.raises(SchemaError, match="give a JSON schema as a dict"):
        resolve_schema(' {"type": "object"}')
    with pytest.raises(SchemaError, match="invalid JSON schema"):
        resolve_schema({"type": "no-such-type"})
    with pytest.raises(SchemaError, match="must be a registered name"):
        resolve_schema(42)
    with pytest.raises(SchemaError, match="pydantic model class"):
        register_schema("bad", dict)


def test_schemas_nested_past_the_limit_are_refused_and_deep_answers_are_errors():
    """Past MAX_SCHEMA_DEPTH nested objects and arrays a schema is a SchemaError, not a RecursionError
    from meta-validation or the grammar compiler; a schema at the limit resolves."""
    from schemas.registry import MAX_SCHEMA_DEPTH

    def nested_arrays(containers: int) -> dict:
        schema: dict = {"type": "string"}
        for _ in range(containers - 1):
            schema = {"type": "array", "items": schema}
        return schema

    assert resolve_schema(nested_arrays(MAX_SCHEMA_DEPTH)).json_schema["type"] == "array"
    for containers in (MAX_SCHEMA_DEPTH + 1, 150, 5000):
        with pytest.raises(SchemaError, match=f"nests more than {MAX_SCHEMA_DEPTH} JSON objects and arrays"):
            resolve_schema(nested_arrays(containers))
    looped: dict = {"type": "object", "properties": {}}
    looped["properties"]["self"] = looped  # only Python objects can do this; refused, not looped over
    with pytest.raises(SchemaError, match="nests more than"):
        resolve_schema(looped)
    with pytest.raises(AnswerValidationError, match="nested too deeply"):
        resolve_schema({"type": "array"}).validate("[" * 5000 + "]" * 5000)


def test_product_record_validation():
    record = ProductRecord(title="t", description="d", image=b"\x89PNG", candidate_categories=["A > B"])
    assert record.id is None and record.ground_truth is None
    assert "image" not in repr(record)
    with pytest.raises(ValidationError, match="candidate_categories"):
        ProductRecord(title="t", description="d", image=b"x", candidate_categories=[])
    with pytest.raises(ValidationError, match="blank"):
        ProductRecord(title="t", description="d", image=b"x", candidate_categories=["A", " "])
    with pytest.raises(ValidationError, match="image is empty"):
        ProductRecord(title="t", description="d", image=b"", candidate_categories=["A"])
