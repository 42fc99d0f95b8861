"""One synthetic record, derived from (seed, index) alone.

Each record has its own random streams (see `seeding.py`): "content" decides
category, brand, attributes, text and candidates; "image" draws the photo;
"image-size" picks its dimensions. So record i is the same whatever `n` is,
and a small and a realistic catalogue with one seed share every label and text.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from schemas import ProductAttributes
from vlm_catalog.data.synthetic.candidates import CandidateSampler
from vlm_catalog.data.synthetic.condition_cues import STICKER_LABELS
from vlm_catalog.data.synthetic.descriptions import compose_description
from vlm_catalog.data.synthetic.images import encode_jpeg, pick_dimensions, render_product_image
from vlm_catalog.data.synthetic.plan import plan_product
from vlm_catalog.data.synthetic.seeding import record_rng
from vlm_catalog.data.synthetic.signature import SignatureBook
from vlm_catalog.data.synthetic.titles import compose_title
from vlm_catalog.data.taxonomy import Taxonomy, load_taxonomy

JPEG_QUALITY_RANGE = (85, 95)


@dataclass(frozen=True)
class SyntheticRecord:
    title: str
    description: str
    image_jpeg: bytes
    candidates: tuple[str, ...]
    category: str
    brand: str
    is_secondhand: bool
    attributes: ProductAttributes


class RecordFactory:
    """Makes the records of catalogues over one taxonomy (by default the shipped subset)."""

    def __init__(self, taxonomy: Taxonomy) -> None:
        self.taxonomy = taxonomy
        self._leaves = taxonomy.leaves()
        self._signatures = SignatureBook(taxonomy)
        self._candidates = CandidateSampler(taxonomy)

    def signature(self, leaf: str):
        """What every photo of `leaf` shows: backdrop, shape, glyph (`signature.VisualSignature`)."""
        return self._signatures[leaf]

    def make(
        self, seed: int, index: int, image_size: str = "small", brand: str | None = None,
        photo_only_condition: bool = False,
    ) -> SyntheticRecord:
        """Record `index` of catalogue `seed`.

        Two overrides for training data. `brand` replaces the brand the plan
        drew, everywhere the listing names it, and changes nothing else (None
        keeps the generator's own brand, as catalogues do).
        `photo_only_condition` makes a second-hand item's photo (its sticker)
        the only sign of its condition, as for a quarter of them in catalogues;
        the same product, but its text and candidates may be drawn differently.
        """
        content = record_rng("content", seed, index)
        category = content.choice(self._leaves)
        plan = plan_product(category, content)
        if brand is not None:
            plan = replace(plan, brand=brand)
        if photo_only_condition and plan.is_secondhand and "sticker" not in plan.image_wear:
            wear = "sticker+scratches" if plan.image_wear == "scratches" else "sticker"
            plan = replace(plan, condition_cue_in_title=False, condition_cue_in_description=False,
                           image_wear=wear)
        title = compose_title(plan, content)
        description = compose_description(plan, title, content)
        candidates = self._candidates.sample(category, content)

        width, height = pick_dimensions(image_size, record_rng("image-size", seed, index))
        drawing = record_rng("image", seed, index)
        image = render_product_image(
            self._signatures[category],
            plan.attributes.colour,
            width,
            height,
            drawing,
            wear=plan.image_wear,
            sticker_label=STICKER_LABELS.get(plan.attributes.condition, "USED"),
        )
        jpeg = encode_jpeg(image, quality=drawing.randint(*JPEG_QUALITY_RANGE))
        return SyntheticRecord(
            title=title,
            description=description,
            image_jpeg=jpeg,
            candidates=tuple(candidates),
            category=category,
            brand=plan.brand,
            is_secondhand=plan.is_secondhand,
            attributes=plan.attributes,
        )


@lru_cache(maxsize=1)
def default_factory() -> RecordFactory:
    """The factory over the shipped taxonomy subset (built once per process)."""
    return RecordFactory(load_taxonomy())
