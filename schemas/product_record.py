"""One input product, as the catalogue loader, the batch job and the service see it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from schemas.product_metadata import ProductAttributes, ProductMetadata


class ProductRecord(BaseModel):
    """A product listing to extract metadata from.

    `image` holds the original encoded bytes (JPEG, PNG, WebP, ...); nothing
    re-encodes or resizes it before the preprocessor. `ground_truth` and
    `attributes` are present only when the record comes from a labelled
    catalogue (for evaluation).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str | None = None
    title: str
    description: str
    image: bytes = Field(repr=False)
    candidate_categories: list[str] = Field(min_length=1)
    ground_truth: ProductMetadata | None = None
    attributes: ProductAttributes | None = None

    @field_validator("image")
    @classmethod
    def _image_not_empty(cls, value: bytes) -> bytes:
        if not value:
            raise ValueError("image is empty: expected the encoded bytes of a JPEG/PNG/WebP/GIF")
        return value

    @field_validator("candidate_categories")
    @classmethod
    def _candidates_not_blank(cls, value: list[str]) -> list[str]:
        for position, category in enumerate(value):
            if not category.strip():
                raise ValueError(f"candidate category at position {position} is blank")
        return value
