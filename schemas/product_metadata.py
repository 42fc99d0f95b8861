"""The benchmark's answer schema, `ProductMetadata`, and a richer one for ingestion.

`ProductMetadata` must produce exactly the JSON schema of the MLPerf reference
(`mlcommons/inference`, `multimodal/qwen3-vl`): the mlperf prompt prints it, so
any difference in a title or description would change the prompt and the
accuracy. `tests/schemas/test_product_metadata.py` pins it.
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict, Field

CATEGORY_SEPARATOR = " > "


class ProductMetadata(BaseModel):
    """Json format for the expected responses from the VLM."""

    model_config = ConfigDict(extra="forbid")

    category: str = Field(
        description=(
            "The complete category of the product, e.g.,\n"
            '"Clothing & Accessories > Clothing > Shirts > Polo Shirts".\n'
            'Each categorical level is separated by " > ".'
        )
    )
    brand: str = Field(description='The brand of the product, e.g., "giorgio armani".')
    is_secondhand: bool = Field(description="True if the product is second-hand, False otherwise.")


class Colour(str, Enum):
    black = "black"
    white = "white"
    grey = "grey"
    red = "red"
    orange = "orange"
    yellow = "yellow"
    green = "green"
    blue = "blue"
    purple = "purple"
    pink = "pink"
    brown = "brown"
    beige = "beige"


class Material(str, Enum):
    cotton = "cotton"
    wool = "wool"
    polyester = "polyester"
    leather = "leather"
    denim = "denim"
    silk = "silk"
    metal = "metal"
    wood = "wood"
    plastic = "plastic"
    glass = "glass"
    ceramic = "ceramic"
    paper = "paper"
    rubber = "rubber"
    stone = "stone"


class TargetGender(str, Enum):
    female = "female"
    male = "male"
    unisex = "unisex"


class AgeGroup(str, Enum):
    adult = "adult"
    kids = "kids"
    baby = "baby"
    all_ages = "all ages"


class Condition(str, Enum):
    new = "new"
    like_new = "like new"
    used = "used"
    refurbished = "refurbished"


class ProductAttributes(BaseModel):
    """Catalogue attributes beyond the benchmark's three fields."""

    model_config = ConfigDict(extra="forbid")

    colour: Colour = Field(description="The dominant colour of the product.")
    material: Material = Field(description="The main material the product is made of.")
    target_gender: TargetGender = Field(description="Who the product is made for.")
    age_group: AgeGroup = Field(description="The age group the product is made for.")
    condition: Condition = Field(
        description='The condition of the item; anything but "new" is second-hand.'
    )


class ProductDetails(ProductMetadata, ProductAttributes):
    """Structured catalogue metadata: the benchmark's fields plus ingestion attributes."""

    model_config = ConfigDict(extra="forbid")


ATTRIBUTE_FIELDS: tuple[str, ...] = tuple(ProductAttributes.model_fields)
