"""The Shopify product taxonomy as a tree of full category paths.

A category is named by its full path, levels joined by `" > "`
(`"Apparel & Accessories > Shoes > Boots"`). The project ships a subset of the
2024-07 taxonomy in `data/taxonomy/shopify_categories_subset.txt`;
`load_taxonomy()` reads it, and any file in the same format (one path a line,
`#` comment lines, every ancestor listed) loads the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import lru_cache
from pathlib import Path

from schemas import CATEGORY_SEPARATOR
from vlm_catalog.paths import TAXONOMY_FILE, shipped_data_hint

DEFAULT_TAXONOMY_PATH = TAXONOMY_FILE  # VLM_CATALOG_DATA moves it, as it moves the other shipped data


class TaxonomyError(ValueError):
    """A taxonomy file or path that cannot be used, or a category that is not in the taxonomy."""


def split_path(path: str) -> list[str]:
    """The levels of a category path, each stripped: `"A > B"` -> `["A", "B"]`."""
    levels = [level.strip() for level in path.split(CATEGORY_SEPARATOR.strip())]
    if any(not level for level in levels):
        raise TaxonomyError(f"category path {path!r} has an empty level")
    return levels


def join_path(levels: Iterable[str]) -> str:
    return CATEGORY_SEPARATOR.join(levels)


class Taxonomy:
    """An immutable category tree; every method takes and returns full paths, in file order."""

    def __init__(self, paths: Iterable[str]) -> None:
        ordered: list[str] = []
        children: dict[str | None, list[str]] = {None: []}
        for raw in paths:
            path = join_path(split_path(raw))
            if path in children:
                raise TaxonomyError(f"category {path!r} is listed twice")
            parent = _parent_of(path)
            if parent is not None and parent not in children:
                raise TaxonomyError(
                    f"category {path!r} is listed before (or without) its parent {parent!r}"
                )
            children[parent].append(path)
            children[path] = []
            ordered.append(path)
        if not ordered:
            raise TaxonomyError("the taxonomy has no categories")
        self._paths: tuple[str, ...] = tuple(ordered)
        self._children = {key: tuple(value) for key, value in children.items()}

    @classmethod
    def from_file(cls, path: str | Path) -> Taxonomy:
        """Read one full path a line; blank lines and lines starting with `#` are skipped."""
        file_path = Path(path)
        try:
            text = file_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise TaxonomyError(f"taxonomy file not found: {file_path}{shipped_data_hint(file_path)}") from None
        lines = [line.strip() for line in text.splitlines()]
        try:
            return cls(line for line in lines if line and not line.startswith("#"))
        except TaxonomyError as exc:
            raise TaxonomyError(f"{file_path}: {exc}") from None

    # -- the whole tree -------------------------------------------------------------------

    @property
    def paths(self) -> tuple[str, ...]:
        return self._paths

    def __len__(self) -> int:
        return len(self._paths)

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __contains__(self, path: object) -> bool:
        return isinstance(path, str) and path in self._children

    def top_levels(self) -> list[str]:
        return list(self._children[None])

    def leaves(self, under: str | None = None) -> list[str]:
        """Categories without children, optionally only those below (or equal to) `under`."""
        if under is not None:
            self._require(under)
            prefix = under + CATEGORY_SEPARATOR
            return [
                p for p in self._paths if self.is_leaf(p) and (p == under or p.startswith(prefix))
            ]
        return [p for p in self._paths if self.is_leaf(p)]

    # -- one category ---------------------------------------------------------------------

    def depth(self, path: str) -> int:
        """Number of levels: 1 for a top-level category."""
        self._require(path)
        return len(split_path(path))

    def parent(self, path: str) -> str | None:
        self._require(path)
        return _parent_of(path)

    def ancestors(self, path: str) -> list[str]:
        """From the top-level category down to the parent."""
        self._require(path)
        levels = split_path(path)
        return [join_path(levels[:end]) for end in range(1, len(levels))]

    def top_level(self, path: str) -> str:
        self._require(path)
        return split_path(path)[0]

    def children(self, path: str) -> list[str]:
        self._require(path)
        return list(self._children[path])

    def is_leaf(self, path: str) -> bool:
        self._require(path)
        return not self._children[path]

    def siblings(self, path: str) -> list[str]:
        """Other children of the same parent (for a top-level category: the other top levels)."""
        self._require(path)
        return [p for p in self._children[_parent_of(path)] if p != path]

    def cousins(self, path: str) -> list[str]:
        """Children of the parent's siblings: same grandparent, different parent.

        Categories of depth 1 or 2 have no grandparent and so no cousins.
        """
        parent = self.parent(path)
        if parent is None or _parent_of(parent) is None:
            return []
        return [cousin for aunt in self.siblings(parent) for cousin in self._children[aunt]]

    def _require(self, path: str) -> None:
        if not isinstance(path, str) or path not in self._children:
            raise TaxonomyError(f"unknown category {path!r}")


def _parent_of(path: str) -> str | None:
    head, separator, _ = path.rpartition(CATEGORY_SEPARATOR)
    return head if separator else None


@lru_cache(maxsize=8)
def _load_cached(resolved: Path) -> Taxonomy:
    return Taxonomy.from_file(resolved)


def load_taxonomy(path: str | Path | None = None) -> Taxonomy:
    """The taxonomy at `path`, by default the subset shipped in `data/taxonomy/` (cached)."""
    return _load_cached(Path(path or DEFAULT_TAXONOMY_PATH).resolve())
