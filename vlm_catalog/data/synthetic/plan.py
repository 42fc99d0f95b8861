"""Every decision about one listing, made once, before any text or pixel is produced.

The title, the description and the image each read the same `ProductPlan`, so
they agree: a colour named in the text is the colour drawn, a second-hand item
has its cue where the plan puts it, and a brand left out of the title is
carried by the description.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from schemas import AgeGroup, Condition, ProductAttributes, TargetGender
from vlm_catalog.data.synthetic.attributes import sample_attributes
from vlm_catalog.data.synthetic.markup import BRAND_CARRIERS, MARKUP_STYLES, MARKUP_WEIGHTS
from vlm_catalog.data.synthetic.vocabulary import COLOUR_WORDS, MATERIAL_PHRASES, brands_for
from vlm_catalog.data.taxonomy import split_path

NAMES_LEAF_RATE = 0.6  # title names the leaf's product; otherwise only the parent's noun
BRAND_IN_TITLE_RATE = 0.65
IMAGE_ONLY_SECONDHAND_RATE = 0.25  # second-hand items whose only cue is the photo


@dataclass(frozen=True)
class ProductPlan:
    category: str
    leaf_noun: str  # the leaf level's name: "Ankle Boots"
    generic_noun: str  # the parent level's name, shared by all siblings: "Boots"
    names_leaf: bool  # text names the leaf; otherwise only `generic_noun` (the photo decides)
    brand: str
    brand_in_title: bool
    # How the description carries the brand: "by" (a sentence), "line" ("Brand: X"),
    # or a structural carrier of the markup ("meta", "json_ld", "tracking"); None: not at all.
    brand_in_description: str | None
    markup: str
    attributes: ProductAttributes
    colour_word: str
    colour_in_title: bool
    colour_in_description: bool
    material_phrase: str
    material_in_title: bool
    audience_in_title: bool  # gender / age group named in the title (else in the description)
    condition_cue_in_title: bool
    condition_cue_in_description: bool
    image_wear: str  # one of images.WEAR_KINDS

    @property
    def noun(self) -> str:
        """The product noun the text uses."""
        return self.leaf_noun if self.names_leaf else self.generic_noun

    @property
    def is_secondhand(self) -> bool:
        return self.attributes.condition is not Condition.new

    @property
    def top_level(self) -> str:
        return split_path(self.category)[0]

    @property
    def has_audience(self) -> bool:
        """Whether the audience is worth naming (not the default unisex adult)."""
        attrs = self.attributes
        return (
            attrs.target_gender is not TargetGender.unisex or attrs.age_group is not AgeGroup.adult
        )


def _condition_cues(is_secondhand: bool, rng: random.Random) -> tuple[bool, bool, str]:
    """(cue in title, cue in description, image wear) for one item."""
    if not is_secondhand:
        return False, False, "none"
    if rng.random() < IMAGE_ONLY_SECONDHAND_RATE:
        return False, False, rng.choice(("sticker", "sticker+scratches"))
    where = rng.choices(("title", "description", "both"), weights=(25, 40, 35))[0]
    wear = "scratches" if rng.random() < 0.35 else "none"
    return where in ("title", "both"), where in ("description", "both"), wear


def plan_product(category: str, rng: random.Random) -> ProductPlan:
    """Decide everything about one listing of `category` (a leaf's full path)."""
    levels = split_path(category)
    attributes = sample_attributes(category, rng)
    names_leaf = len(levels) == 1 or rng.random() < NAMES_LEAF_RATE

    brand = rng.choice(brands_for(levels[0]))
    brand_in_title = rng.random() < BRAND_IN_TITLE_RATE
    markup = rng.choices(MARKUP_STYLES, weights=MARKUP_WEIGHTS)[0]
    carriers = ["by", "line"] + ([BRAND_CARRIERS[markup]] if markup in BRAND_CARRIERS else [])
    if not brand_in_title:
        brand_in_description: str | None = rng.choice(carriers)
    elif rng.random() < 0.4:
        brand_in_description = rng.choice(("by", "line"))
    else:
        brand_in_description = None

    colour_words = COLOUR_WORDS[attributes.colour]
    colour_word = colour_words[0] if rng.random() < 0.7 else rng.choice(colour_words[1:])
    colour_in_title = rng.random() < 0.5
    colour_in_description = rng.random() < (0.4 if colour_in_title else 0.7)

    cue_in_title, cue_in_description, wear = _condition_cues(
        attributes.condition is not Condition.new, rng
    )
    return ProductPlan(
        category=category,
        leaf_noun=levels[-1],
        generic_noun=levels[-2] if len(levels) > 1 else levels[-1],
        names_leaf=names_leaf,
        brand=brand,
        brand_in_title=brand_in_title,
        brand_in_description=brand_in_description,
        markup=markup,
        attributes=attributes,
        colour_word=colour_word,
        colour_in_title=colour_in_title,
        colour_in_description=colour_in_description,
        material_phrase=rng.choice(MATERIAL_PHRASES[attributes.material]),
        material_in_title=rng.random() < 0.2,
        audience_in_title=rng.random() < 0.55,
        condition_cue_in_title=cue_in_title,
        condition_cue_in_description=cue_in_description,
        image_wear=wear,
    )
