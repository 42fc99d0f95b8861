"""Each leaf category's visual signature: what its product photos always show.

Three parts, each chosen from a stable SHA-256 hash of a category path and kept
distinct where the text may be ambiguous:

- backdrop (pattern and tint): from the top-level category, distinct across top levels;
- shape of the product: from the parent category, distinct among the parents
  within one top level, so sibling groups and cousin groups look different;
- glyph printed on the product: from the leaf, distinct among siblings, so the
  photo tells siblings apart when the title names only the parent's product.

Together the three make the signature unique to the leaf within the taxonomy.
A hash picks a preferred option; clashes are resolved by taking the next free
one, in path order, so the result depends only on the taxonomy.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from vlm_catalog.data.synthetic.seeding import stable_int
from vlm_catalog.data.taxonomy import Taxonomy, TaxonomyError

SHAPES = (
    "circle", "rounded_square", "triangle", "hexagon", "diamond", "capsule", "wide_box",
    "trapezoid", "arch", "shield", "bottle", "tag",
)  # fmt: skip
GLYPHS = (
    "plus", "cross", "dot", "ring", "hbars", "vbars", "chevron", "triangle", "square",
    "hollow_square", "dot_grid", "diagonals", "checker", "star", "zigzag", "crescent",
)  # fmt: skip
BACKDROP_PATTERNS = ("plain", "horizon", "stripes", "dots", "frame")
# Light, slightly coloured studio backgrounds; every product colour stands out against them.
BACKDROP_TINTS: tuple[tuple[int, int, int], ...] = (
    (228, 228, 228),  # light grey
    (236, 227, 213),  # warm
    (216, 225, 237),  # cool
    (221, 234, 222),  # mint
)


@dataclass(frozen=True)
class VisualSignature:
    backdrop_pattern: str
    backdrop_tint: tuple[int, int, int]
    shape: str
    glyph: str


def _assign_distinct(keys: Iterable[str], option_count: int, salt: str) -> dict[str, int]:
    """Give each key a different option index, starting from its hash's preference."""
    assigned: dict[str, int] = {}
    taken: set[int] = set()
    ordered = sorted(set(keys))
    if len(ordered) > option_count:
        raise TaxonomyError(
            f"{len(ordered)} categories need distinct {salt} but only {option_count} exist: "
            f"{ordered[:3]}..."
        )
    for key in ordered:
        choice = stable_int(salt, key) % option_count
        while choice in taken:
            choice = (choice + 1) % option_count
        taken.add(choice)
        assigned[key] = choice
    return assigned


class SignatureBook:
    """The visual signatures of every leaf of a taxonomy."""

    def __init__(self, taxonomy: Taxonomy) -> None:
        leaves = taxonomy.leaves()
        backdrop_count = len(BACKDROP_PATTERNS) * len(BACKDROP_TINTS)
        backdrops = _assign_distinct(taxonomy.top_levels(), backdrop_count, "backdrops")

        groups_by_top: dict[str, set[str]] = defaultdict(set)
        leaves_by_group: dict[str, list[str]] = defaultdict(list)
        for leaf in leaves:
            group = taxonomy.parent(leaf) or leaf  # a top-level leaf is its own group
            groups_by_top[taxonomy.top_level(leaf)].add(group)
            leaves_by_group[group].append(leaf)
        shapes: dict[str, int] = {}
        for groups in groups_by_top.values():
            shapes.update(_assign_distinct(groups, len(SHAPES), "shapes"))
        glyphs: dict[str, int] = {}
        for siblings in leaves_by_group.values():
            glyphs.update(_assign_distinct(siblings, len(GLYPHS), "glyphs"))

        self._signatures: dict[str, VisualSignature] = {}
        for leaf in leaves:
            pattern, tint = divmod(backdrops[taxonomy.top_level(leaf)], len(BACKDROP_TINTS))
            self._signatures[leaf] = VisualSignature(
                backdrop_pattern=BACKDROP_PATTERNS[pattern],
                backdrop_tint=BACKDROP_TINTS[tint],
                shape=SHAPES[shapes[taxonomy.parent(leaf) or leaf]],
                glyph=GLYPHS[glyphs[leaf]],
            )

    def __getitem__(self, leaf: str) -> VisualSignature:
        try:
            return self._signatures[leaf]
        except KeyError:
            raise TaxonomyError(f"no visual signature for {leaf!r}: not a leaf category") from None

    def __len__(self) -> int:
        return len(self._signatures)
