"""Words the synthetic listings are made of: brands, adjectives, colour and material phrases.

Everything here is a fixed, deterministic vocabulary; records choose from it
with their own random streams. Second-hand wording lives in `condition_cues.py`
and nothing in this module may contain it.
"""

from __future__ import annotations

import random
from functools import lru_cache

from schemas import Colour, Material
from vlm_catalog.data.synthetic.seeding import stable_int

# -- brands ---------------------------------------------------------------------------------

_BRAND_HEADS = (
    "Nor", "Bel", "Cal", "Dun", "Elm", "Fen", "Gal", "Hal", "Ivo", "Jun", "Kes", "Lom", "Mar",
    "Nev", "Oak", "Pel", "Quin", "Ros", "Sol", "Tam", "Ulv", "Vel", "Wen", "Yar", "Zel", "Bram",
    "Cor", "Dal",
)  # fmt: skip
_BRAND_TAILS = (
    "dell", "wick", "mont", "vale", "ora", "ix", "ana", "by", "ton", "stead", "ridge", "holm",
    "vik", "ette", "ford", "lune",
)  # fmt: skip
# How a stem becomes a brand name; the stem is the `{}`.
_BRAND_STYLES = (
    "{}", "{}", "{}", "{}", "{}", "{} & Co.", "{} Studio", "{} Goods", "{} Labs", "House of {}",
    "{} Supply", "{} Outfitters", "Atelier {}", "{} Works",
)  # fmt: skip
BRAND_COUNT = 320
BRANDS_PER_TOP_LEVEL = 24


@lru_cache(maxsize=1)
def brand_names() -> tuple[str, ...]:
    """The synthetic brand vocabulary: `BRAND_COUNT` distinct, made-up names in natural casing."""
    stems = [head + tail for head in _BRAND_HEADS for tail in _BRAND_TAILS]
    chooser = random.Random(stable_int("brand vocabulary"))
    chooser.shuffle(stems)
    names: list[str] = []
    for stem in stems[:BRAND_COUNT]:
        style = chooser.choice(_BRAND_STYLES)
        casing = chooser.random()
        if casing < 0.06:
            stem = stem.upper()  # stylised: "ZELIX"
        elif casing < 0.10:
            stem = stem.lower()  # stylised: "oakvale"
        names.append(style.format(stem))
    return tuple(names)


@lru_cache(maxsize=64)
def brands_for(top_level: str) -> tuple[str, ...]:
    """The brands that sell in one top-level category (a fixed sample; brands may span several)."""
    chooser = random.Random(stable_int("brands for", top_level))
    return tuple(chooser.sample(brand_names(), BRANDS_PER_TOP_LEVEL))


# -- descriptive words ----------------------------------------------------------------------

ADJECTIVES = (
    "Classic", "Premium", "Everyday", "Compact", "Deluxe", "Essential", "Modern", "Lightweight",
    "Durable", "Handcrafted", "Signature", "Heavy-Duty", "Slim", "Pro", "Ultra", "Original",
    "Portable", "Elegant", "Minimalist", "Rustic",
)  # fmt: skip

# Text names of each colour: the first is the plain name; the others contain it too, except "gray".
COLOUR_WORDS: dict[Colour, tuple[str, ...]] = {
    Colour.black: ("black", "jet black", "matte black"),
    Colour.white: ("white", "snow white", "off-white"),
    Colour.grey: ("grey", "gray", "slate grey"),
    Colour.red: ("red", "deep red", "cherry red"),
    Colour.orange: ("orange", "burnt orange"),
    Colour.yellow: ("yellow", "mustard yellow", "lemon yellow"),
    Colour.green: ("green", "forest green", "olive green"),
    Colour.blue: ("blue", "navy blue", "cobalt blue"),
    Colour.purple: ("purple", "royal purple"),
    Colour.pink: ("pink", "blush pink", "hot pink"),
    Colour.brown: ("brown", "chocolate brown", "walnut brown"),
    Colour.beige: ("beige", "sand beige"),
}

# Phrases naming each material; every phrase contains the material's own word.
MATERIAL_PHRASES: dict[Material, tuple[str, ...]] = {
    Material.cotton: ("100% cotton", "soft cotton", "organic cotton"),
    Material.wool: ("merino wool", "pure wool", "a wool blend"),
    Material.polyester: ("recycled polyester", "polyester", "water-resistant polyester"),
    Material.leather: ("genuine leather", "full-grain leather", "soft leather"),
    Material.denim: ("stretch denim", "heavyweight denim", "denim"),
    Material.silk: ("pure silk", "mulberry silk"),
    Material.metal: ("brushed metal", "die-cast metal", "solid metal"),
    Material.wood: ("solid wood", "oiled oak wood", "bamboo wood"),
    Material.plastic: ("BPA-free plastic", "recycled plastic", "impact-resistant plastic"),
    Material.glass: ("tempered glass", "borosilicate glass", "clear glass"),
    Material.ceramic: ("glazed ceramic", "ceramic", "stoneware ceramic"),
    Material.paper: ("recycled paper", "heavyweight paper", "acid-free paper"),
    Material.rubber: ("natural rubber", "non-slip rubber", "silicone rubber"),
    Material.stone: ("natural stone", "marble stone", "polished stone"),
}

# Plausible main materials for each top-level category (first-level name of the path).
MATERIALS_BY_TOP_LEVEL: dict[str, tuple[Material, ...]] = {
    "Animals & Pet Supplies": (Material.plastic, Material.rubber, Material.polyester,
                               Material.cotton, Material.metal, Material.wood),
    "Apparel & Accessories": (Material.cotton, Material.wool, Material.polyester,
                              Material.leather, Material.denim, Material.silk),
    "Arts & Entertainment": (Material.paper, Material.wood, Material.plastic, Material.metal,
                             Material.glass, Material.ceramic),
    "Baby & Toddler": (Material.cotton, Material.plastic, Material.polyester, Material.wood,
                       Material.rubber),
    "Business & Industrial": (Material.metal, Material.plastic, Material.rubber, Material.paper),
    "Cameras & Optics": (Material.plastic, Material.metal, Material.glass),
    "Electronics": (Material.plastic, Material.metal, Material.glass),
    "Food, Beverages & Tobacco": (Material.paper, Material.glass, Material.plastic),
    "Furniture": (Material.wood, Material.metal, Material.glass, Material.leather,
                  Material.polyester, Material.stone),
    "Hardware": (Material.metal, Material.plastic, Material.rubber, Material.wood, Material.stone),
    "Health & Beauty": (Material.plastic, Material.glass, Material.metal, Material.cotton),
    "Home & Garden": (Material.ceramic, Material.glass, Material.wood, Material.metal,
                      Material.cotton, Material.stone, Material.plastic),
    "Luggage & Bags": (Material.leather, Material.polyester, Material.cotton, Material.denim,
                       Material.plastic),
    "Media": (Material.paper, Material.plastic),
    "Office Supplies": (Material.paper, Material.plastic, Material.metal, Material.wood),
    "Sporting Goods": (Material.rubber, Material.plastic, Material.metal, Material.polyester,
                       Material.wood),
    "Toys & Games": (Material.plastic, Material.wood, Material.cotton, Material.paper,
                     Material.polyester),
    "Vehicles & Parts": (Material.metal, Material.rubber, Material.plastic),
}  # fmt: skip
FALLBACK_MATERIALS: tuple[Material, ...] = (Material.plastic, Material.metal, Material.paper)


def materials_for(top_level: str) -> tuple[Material, ...]:
    return MATERIALS_BY_TOP_LEVEL.get(top_level, FALLBACK_MATERIALS)


# Sentences that suit any new product. They must never read as second-hand.
FILLER_SENTENCES = (
    "Easy to clean and maintain.",
    "Designed for daily use at home or on the go.",
    "Ships within 1-2 business days.",
    "Free returns within 30 days.",
    "Satisfaction guaranteed or your money back.",
    "Makes a thoughtful gift.",
    "Backed by a {years}-year limited warranty.",
    "Please allow for slight colour differences between screens.",
    "Care: wipe clean with a damp cloth.",
    "Limited stock available.",
    "Measures approximately {width} x {height} cm.",
    "Weighs about {grams} g.",
    "Thoughtfully designed and quality checked before dispatch.",
    "Dispatched in recyclable packaging.",
)

TITLE_DETAILS = (
    ", Size {size}", " ({pack}-Pack)", " - {volume} ml", " Model {model}", ", {width} cm",
    " - Set of {pack}", " | {width} x {height} cm",
)  # fmt: skip
SIZES = ("XS", "S", "M", "L", "XL", "One Size")


# -- fresh brands (training data) -----------------------------------------------------------

_FRESH_ONSETS = (
    "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
    "br", "ch", "cl", "dr", "fl", "gr", "kr", "pl", "qu", "sh", "st", "th", "tr", "",
)  # fmt: skip
_FRESH_VOWELS = ("a", "e", "i", "o", "u", "y", "ae", "io", "ou", "ea")
_FRESH_CODAS = ("", "", "", "", "", "n", "r", "s", "x", "l", "m", "k", "t", "nd", "rk", "st", "ck")
_FRESH_STYLES = _BRAND_STYLES + ("{} Co.", "The {} Company", "{} Home", "{} & Sons", "{} {}")


def _fresh_stem(rng: random.Random) -> str:
    syllables = rng.choice((1, 2, 2, 2, 2, 3))
    return "".join(
        rng.choice(_FRESH_ONSETS) + rng.choice(_FRESH_VOWELS) + rng.choice(_FRESH_CODAS)
        for _ in range(syllables)
    )


def fresh_brand(rng: random.Random, stems: tuple[str, ...] = ()) -> str:
    """A made-up brand name drawn from `rng`, almost never one of `brand_names()`.

    For training data: a model shown brands it cannot have memorised must learn
    to copy the brand from the listing's text. Each stem is a random syllable
    string, or, when `stems` is given, one of those words (e.g. whole tokens of
    a tokenizer, so copying a brand means copying a few whole tokens, as with
    the real vocabulary). Casing and styles vary as in the fixed vocabulary.
    """
    style = rng.choice(_FRESH_STYLES)
    names = []
    for _ in range(style.count("{}")):
        if stems:
            stem = rng.choice(stems)
            if rng.random() < 0.3:
                stem += rng.choice(stems).lower()
        else:
            stem = _fresh_stem(rng)
            while len(stem) < 3:
                stem += _fresh_stem(rng)
        casing = rng.random()
        if casing < 0.08:
            stem = stem.upper()
        elif casing < 0.14:
            stem = stem.lower()
        else:
            stem = stem[:1].upper() + stem[1:]
        names.append(stem)
    return style.format(*names)
