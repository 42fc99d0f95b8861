"""The hidden facts of one product: colour, material, audience and condition.

Choices are plausible for the category: materials come from its top-level
category, audiences from the top level plus words in the path ("Baby",
"Kids'", "Women's"), and food is never sold second-hand.
"""

from __future__ import annotations

import random

from schemas import AgeGroup, Colour, Condition, ProductAttributes, TargetGender
from vlm_catalog.data.synthetic.vocabulary import materials_for
from vlm_catalog.data.taxonomy import split_path

SECONDHAND_RATE = 0.24
SECONDHAND_RATE_BY_TOP_LEVEL = {"Food, Beverages & Tobacco": 0.0, "Health & Beauty": 0.08}
# Top levels where a second-hand item is often refurbished rather than just used.
REFURBISHABLE = {
    "Electronics",
    "Cameras & Optics",
    "Hardware",
    "Vehicles & Parts",
    "Business & Industrial",
    "Health & Beauty",
}

_G, _A = TargetGender, AgeGroup
# (value, weight) tables by top-level category.
_GENDER_WEIGHTS: dict[str, tuple[tuple[TargetGender, float], ...]] = {
    "Apparel & Accessories": ((_G.female, 0.4), (_G.male, 0.3), (_G.unisex, 0.3)),
    "Luggage & Bags": ((_G.female, 0.2), (_G.male, 0.1), (_G.unisex, 0.7)),
    "Health & Beauty": ((_G.female, 0.3), (_G.male, 0.15), (_G.unisex, 0.55)),
    "Sporting Goods": ((_G.female, 0.15), (_G.male, 0.15), (_G.unisex, 0.7)),
    "Baby & Toddler": ((_G.female, 0.2), (_G.male, 0.2), (_G.unisex, 0.6)),
}
_AGE_WEIGHTS: dict[str, tuple[tuple[AgeGroup, float], ...]] = {
    "Apparel & Accessories": ((_A.adult, 0.75), (_A.kids, 0.2), (_A.baby, 0.05)),
    "Baby & Toddler": ((_A.baby, 0.75), (_A.kids, 0.25)),
    "Toys & Games": ((_A.kids, 0.65), (_A.all_ages, 0.35)),
    "Sporting Goods": ((_A.adult, 0.7), (_A.kids, 0.15), (_A.all_ages, 0.15)),
    "Media": ((_A.adult, 0.5), (_A.all_ages, 0.5)),
    "Arts & Entertainment": ((_A.adult, 0.6), (_A.all_ages, 0.4)),
    "Food, Beverages & Tobacco": ((_A.adult, 0.6), (_A.all_ages, 0.4)),
}
# Words in a category path that fix the audience.
_AGE_WORDS = {
    "Baby": AgeGroup.baby,
    "Nursery": AgeGroup.baby,
    "Kids'": AgeGroup.kids,
    "Toddler": AgeGroup.kids,
    "Youth": AgeGroup.kids,
}
_ADULT_WOMEN_WORDS = ("Breast", "Maternity")  # products for the mother, even under "Baby"
_GENDER_WORDS = {
    "Women's": TargetGender.female,
    "Female": TargetGender.female,
    "Men's": TargetGender.male,
    "Male": TargetGender.male,
}
_FEMALE_LEANING = ("Heels", "Blouses", "Tunics", "Bodysuits", "Makeup", "Epilators")


def _weighted(rng: random.Random, table: tuple[tuple[object, float], ...]):
    values, weights = zip(*table, strict=True)
    return rng.choices(values, weights=weights)[0]


def _path_words(category: str) -> set[str]:
    return {word for level in split_path(category) for word in level.split()}


def sample_audience(category: str, rng: random.Random) -> tuple[TargetGender, AgeGroup]:
    top_level = split_path(category)[0]
    words = _path_words(category)
    if any(word in words for word in _ADULT_WOMEN_WORDS):
        return TargetGender.female, AgeGroup.adult
    age_hint = next((age for word, age in _AGE_WORDS.items() if word in words), None)
    gender_hint = next((gender for word, gender in _GENDER_WORDS.items() if word in words), None)
    gender = _weighted(rng, _GENDER_WEIGHTS.get(top_level, ((TargetGender.unisex, 1.0),)))
    if gender_hint is not None:
        gender = gender_hint
    elif any(word in category for word in _FEMALE_LEANING) and rng.random() < 0.85:
        gender = TargetGender.female
    age = _weighted(rng, _AGE_WEIGHTS.get(top_level, ((AgeGroup.adult, 1.0),)))
    if top_level == "Baby & Toddler":
        age = age if age in (AgeGroup.baby, AgeGroup.kids) else AgeGroup.baby
    elif age_hint is not None:
        age = age_hint
    if age is AgeGroup.all_ages:
        gender = TargetGender.unisex  # "for all ages" products are not gendered
    return gender, age


def sample_condition(top_level: str, rng: random.Random) -> Condition:
    if rng.random() >= SECONDHAND_RATE_BY_TOP_LEVEL.get(top_level, SECONDHAND_RATE):
        return Condition.new
    if top_level in REFURBISHABLE:
        table = ((Condition.used, 0.35), (Condition.like_new, 0.25), (Condition.refurbished, 0.4))
    else:
        table = ((Condition.used, 0.6), (Condition.like_new, 0.35), (Condition.refurbished, 0.05))
    return _weighted(rng, table)


def sample_attributes(category: str, rng: random.Random) -> ProductAttributes:
    """Attributes of a product of `category` (a full path), drawn from `rng`."""
    top_level = split_path(category)[0]
    gender, age = sample_audience(category, rng)
    return ProductAttributes(
        colour=rng.choice(list(Colour)),
        material=rng.choice(materials_for(top_level)),
        target_gender=gender,
        age_group=age,
        condition=sample_condition(top_level, rng),
    )
