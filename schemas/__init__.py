"""Output and input schemas for catalogue extraction (pydantic v2)."""

from schemas.product_metadata import (
    ATTRIBUTE_FIELDS,
    CATEGORY_SEPARATOR,
    AgeGroup,
    Colour,
    Condition,
    Material,
    ProductAttributes,
    ProductDetails,
    ProductMetadata,
    TargetGender,
)
from schemas.product_record import ProductRecord
from schemas.registry import (
    AnswerValidationError,
    OutputSchema,
    SchemaError,
    register_schema,
    resolve_schema,
    schema_names,
)

__all__ = [
    "ATTRIBUTE_FIELDS",
    "CATEGORY_SEPARATOR",
    "AgeGroup",
    "AnswerValidationError",
    "Colour",
    "Condition",
    "Material",
    "OutputSchema",
    "ProductAttributes",
    "ProductDetails",
    "ProductMetadata",
    "ProductRecord",
    "SchemaError",
    "TargetGender",
    "register_schema",
    "resolve_schema",
    "schema_names",
]
