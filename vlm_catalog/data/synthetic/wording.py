"""Small wording helpers shared by titles and descriptions: nouns in sentences, audiences."""

from __future__ import annotations

import random

from schemas import AgeGroup, ProductAttributes, TargetGender
from vlm_catalog.data.synthetic.vocabulary import SIZES, TITLE_DETAILS

SIZED_TOP_LEVELS = {"Apparel & Accessories"}  # titles may say ", Size M"
LIQUID_TOP_LEVELS = {
    "Food, Beverages & Tobacco",
    "Health & Beauty",
    "Baby & Toddler",
    "Home & Garden",
}


def in_sentence(noun: str) -> str:
    """A catalogue name mid-sentence: "Ankle Boots" -> "ankle boots"; "LED Lamps" is kept."""
    return " ".join(
        word.lower() if word[:1].isupper() and word[1:].islower() else word for word in noun.split()
    )


def capitalise(sentence: str) -> str:
    return sentence[:1].upper() + sentence[1:]


def audience_label(attributes: ProductAttributes) -> str | None:
    """The audience as a title says it ("Women's", "Kids'", "for All Ages"); None: unisex adults."""
    gender, age = attributes.target_gender, attributes.age_group
    if age is AgeGroup.baby:
        return {TargetGender.female: "Baby Girl", TargetGender.male: "Baby Boy"}.get(gender, "Baby")
    if age is AgeGroup.kids:
        return {TargetGender.female: "Girls'", TargetGender.male: "Boys'"}.get(gender, "Kids'")
    if age is AgeGroup.all_ages:
        return "for All Ages"
    return {TargetGender.female: "Women's", TargetGender.male: "Men's"}.get(gender)


def audience_sentence(attributes: ProductAttributes, rng: random.Random) -> str:
    """A description sentence naming the audience (gender and age group)."""
    gender, age = attributes.target_gender, attributes.age_group
    if age is AgeGroup.baby:
        who = {TargetGender.female: "baby girls", TargetGender.male: "baby boys"}.get(
            gender, "babies"
        )
        return rng.choice((f"Made for {who} from 0 to 24 months.", f"Soft and safe for {who}."))
    if age is AgeGroup.kids:
        who = {TargetGender.female: "girls", TargetGender.male: "boys"}.get(gender, "kids")
        return rng.choice((f"Sized for {who} aged 4 to 12.", f"Designed with {who} in mind."))
    if age is AgeGroup.all_ages:
        return rng.choice(
            ("Fun for all ages.", "Suitable for all ages, from kids to grandparents.")
        )
    who = {TargetGender.female: "women", TargetGender.male: "men"}.get(gender, "adults")
    return rng.choice((f"Designed for {who}.", f"A favourite with {who} who value quality."))


def title_detail(top_level: str, rng: random.Random) -> str:
    """A trailing size, pack or model detail for a title: ", Size M", " (2-Pack)"."""
    details = [
        detail
        for detail in TITLE_DETAILS
        if ("{size}" not in detail or top_level in SIZED_TOP_LEVELS)
        and ("{volume}" not in detail or top_level in LIQUID_TOP_LEVELS)
    ]
    return rng.choice(details).format(
        size=rng.choice(SIZES),
        pack=rng.choice((2, 3, 4, 6, 12)),
        volume=rng.choice((250, 330, 500, 750, 1000)),
        model=f"{rng.choice('ABCDEFGHKLMNPRSTVX')}{rng.randint(100, 990)}",
        width=rng.randint(10, 120),
        height=rng.randint(10, 120),
    )
