"""Product descriptions: the useful sentences first, then the markup around them.

`compose_description_content` writes what a shopper would read (product noun,
material, colour, audience, condition, brand); `markup.render_description`
then wraps it as plain text or in HTML, CSS and JavaScript.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from vlm_catalog.data.synthetic.condition_cues import DESCRIPTION_CUES
from vlm_catalog.data.synthetic.markup import render_description
from vlm_catalog.data.synthetic.plan import ProductPlan
from vlm_catalog.data.synthetic.vocabulary import ADJECTIVES, FILLER_SENTENCES
from vlm_catalog.data.synthetic.wording import audience_sentence, capitalise, in_sentence

_INTROS = (
    "Discover our {adj} {noun}{by}.",
    "{adj} {noun}{by}, made to last.",
    "Meet the {noun}{by}: {adj}, practical and ready for every day.",
    "These {noun}{by} combine {adj} looks with practical details.",
    "Shop {noun}{by}, built for comfort and reliability.",
)
_MATERIAL_SENTENCES = (
    "Made from {material}.",
    "Crafted from {material} for a long life.",
    "Material: {material}.",
    "Constructed of {material}.",
    "{material} construction.",
)
_COLOUR_SENTENCES = ("Colour: {colour}.", "Finished in {colour}.", "Shown here in {colour}.")
_CARE = ("Wipe clean", "Hand wash only", "Machine washable at 30 degrees", "Dust with a dry cloth")


@dataclass(frozen=True)
class DescriptionContent:
    """What the description says, before any markup."""

    paragraphs: tuple[tuple[str, ...], ...]  # sentences, grouped by paragraph
    features: tuple[str, ...]  # "Key: value" items, shown as a list
    brand_line: str | None  # "Brand: X", on its own line


def _filler(rng: random.Random, width: int, height: int) -> list[str]:
    sentences = rng.sample(FILLER_SENTENCES, k=rng.randint(1, 3))
    return [
        s.format(
            years=rng.choice((1, 2, 3, 5)), width=width, height=height, grams=rng.randint(40, 2500)
        )
        for s in sentences
    ]


def compose_description_content(plan: ProductPlan, rng: random.Random) -> DescriptionContent:
    by = ""
    if plan.brand_in_description == "by":
        by = f" {rng.choice(('by', 'from'))} {plan.brand}"
    adjective = rng.choice(ADJECTIVES).lower()
    intro = rng.choice(_INTROS).format(adj=adjective, noun=in_sentence(plan.noun), by=by)
    first = [capitalise(intro)]
    if plan.colour_in_description:
        first.append(rng.choice(_COLOUR_SENTENCES).format(colour=plan.colour_word))
    first.append(capitalise(rng.choice(_MATERIAL_SENTENCES).format(material=plan.material_phrase)))

    second: list[str] = []
    if plan.has_audience and (not plan.audience_in_title or rng.random() < 0.3):
        second.append(audience_sentence(plan.attributes, rng))
    width, height = rng.randint(5, 90), rng.randint(5, 90)  # cm, for every mention
    second.extend(_filler(rng, width, height))
    if plan.condition_cue_in_description:
        cue = rng.choice(DESCRIPTION_CUES[plan.attributes.condition])
        if rng.random() < 0.5:
            first.append(cue)
        else:
            second.insert(0, cue)

    features: list[str] = []
    if rng.random() < 0.45:
        features.append(f"Material: {capitalise(plan.material_phrase)}")
        if plan.colour_in_description:
            features.append(f"Colour: {plan.colour_word.title()}")
        features.append(f"Dimensions: {width} x {height} cm")
        if rng.random() < 0.5:
            features.append(f"Care: {rng.choice(_CARE)}")
    brand_line = f"Brand: {plan.brand}" if plan.brand_in_description == "line" else None
    return DescriptionContent(tuple(map(tuple, (first, second))), tuple(features), brand_line)


def compose_description(plan: ProductPlan, title: str, rng: random.Random) -> str:
    """The full description of a listing, in the markup style its plan chose."""
    return render_description(compose_description_content(plan, rng), plan, title, rng)
