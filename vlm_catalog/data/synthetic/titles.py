"""Product titles: "Nordell Women's Navy Blue Ankle Boots (2-Pack)", "Pre-Owned Boots - Velora"."""

from __future__ import annotations

import random

from vlm_catalog.data.synthetic.condition_cues import TITLE_CUES
from vlm_catalog.data.synthetic.plan import ProductPlan
from vlm_catalog.data.synthetic.vocabulary import ADJECTIVES
from vlm_catalog.data.synthetic.wording import audience_label, title_detail

_BRANDED_TEMPLATES = (
    "{brand} {core}{detail}",
    "{brand} {core}{detail}",
    "{core}{detail} - {brand}",
    "{core} by {brand}{detail}",
    "{brand} | {core}{detail}",
)
_CUE_TEMPLATES = ("{cue} {title}", "{title} ({cue})", "{title} - {cue}", "[{upper}] {title}")


def compose_title(plan: ProductPlan, rng: random.Random) -> str:
    words: list[str] = []
    label = audience_label(plan.attributes) if plan.audience_in_title else None
    if label and not label.startswith("for "):
        words.append(label)
    if rng.random() < 0.45:
        words.append(rng.choice(ADJECTIVES))
    if plan.colour_in_title:
        words.append(plan.colour_word.title())
    if plan.material_in_title:
        words.append(plan.attributes.material.value.title())
    words.append(plan.noun)
    if label and label.startswith("for "):
        words.append(label)
    core = " ".join(words)
    detail = title_detail(plan.top_level, rng) if rng.random() < 0.4 else ""

    template = rng.choice(_BRANDED_TEMPLATES) if plan.brand_in_title else "{core}{detail}"
    title = template.format(brand=plan.brand, core=core, detail=detail)
    if plan.condition_cue_in_title:
        cue = rng.choice(TITLE_CUES[plan.attributes.condition])
        title = rng.choice(_CUE_TEMPLATES).format(cue=cue, upper=cue.upper(), title=title)
    return title
