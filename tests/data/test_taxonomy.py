"""The taxonomy tree helpers and the shipped Shopify subset."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from vlm_catalog.data.taxonomy import (
    DEFAULT_TAXONOMY_PATH,
    Taxonomy,
    TaxonomyError,
    load_taxonomy,
    split_path,
)

FULL_TAXONOMY = Path("/work/shared/data/shopify_categories.txt")  # only where present

TREE = [
    "Home",
    "Home > Kitchen",
    "Home > Kitchen > Cookware",
    "Home > Kitchen > Cookware > Pans",
    "Home > Kitchen > Cookware > Pots",
    "Home > Kitchen > Cookware > Woks",
    "Home > Kitchen > Tableware",
    "Home > Kitchen > Tableware > Cups",
    "Home > Kitchen > Tableware > Plates",
    "Home > Garden",
    "Toys",
]


@pytest.fixture()
def tree() -> Taxonomy:
    return Taxonomy(TREE)


def test_tree_navigation(tree: Taxonomy) -> None:
    pans = "Home > Kitchen > Cookware > Pans"
    assert tree.depth(pans) == 4
    assert tree.depth("Toys") == 1
    assert tree.parent(pans) == "Home > Kitchen > Cookware"
    assert tree.parent("Home") is None
    assert tree.ancestors(pans) == ["Home", "Home > Kitchen", "Home > Kitchen > Cookware"]
    assert tree.top_level(pans) == "Home"
    assert tree.children("Home > Kitchen") == [
        "Home > Kitchen > Cookware",
        "Home > Kitchen > Tableware",
    ]
    assert tree.siblings(pans) == [
        "Home > Kitchen > Cookware > Pots",
        "Home > Kitchen > Cookware > Woks",
    ]
    assert tree.siblings("Home") == ["Toys"]
    assert tree.cousins(pans) == [
        "Home > Kitchen > Tableware > Cups",
        "Home > Kitchen > Tableware > Plates",
    ]
    assert tree.top_levels() == ["Home", "Toys"]


def test_cousins_need_a_grandparent(tree: Taxonomy) -> None:
    assert tree.cousins("Home > Garden") == []
    assert tree.cousins("Toys") == []
    assert tree.cousins("Home > Kitchen > Cookware") == []  # its parent has no siblings


def test_leaves(tree: Taxonomy) -> None:
    assert tree.leaves() == [
        "Home > Kitchen > Cookware > Pans",
        "Home > Kitchen > Cookware > Pots",
        "Home > Kitchen > Cookware > Woks",
        "Home > Kitchen > Tableware > Cups",
        "Home > Kitchen > Tableware > Plates",
        "Home > Garden",
        "Toys",
    ]
    assert tree.leaves(under="Home > Kitchen > Tableware") == [
        "Home > Kitchen > Tableware > Cups",
        "Home > Kitchen > Tableware > Plates",
    ]
    assert tree.leaves(under="Toys") == ["Toys"]
    assert tree.is_leaf("Toys") and not tree.is_leaf("Home")


def test_paths_are_normalised_and_membership(tree: Taxonomy) -> None:
    spaced = Taxonomy(["A", "A  >B ", "A > B > C"])
    assert spaced.paths == ("A", "A > B", "A > B > C")
    assert split_path(" A >  B ") == ["A", "B"]
    assert "Home > Kitchen" in tree and "Home > Attic" not in tree and 3 not in tree
    assert len(tree) == len(TREE) and list(tree) == TREE


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        ([], "no categories"),
        (["A", "A"], "listed twice"),
        (["A", "A > B > C"], "its parent 'A > B'"),
        (["A", "A >  > B"], "empty level"),
    ],
)
def test_bad_trees_are_refused(paths: list[str], message: str) -> None:
    with pytest.raises(TaxonomyError, match=message):
        Taxonomy(paths)


def test_unknown_category_is_named(tree: Taxonomy) -> None:
    with pytest.raises(TaxonomyError, match="unknown category 'Home > Attic'"):
        tree.siblings("Home > Attic")
    with pytest.raises(TaxonomyError, match="unknown category"):
        tree.leaves(under="Nowhere")


def test_file_loading_skips_comments(tmp_path: Path) -> None:
    path = tmp_path / "tax.txt"
    path.write_text("# a header line\nA\n\nA > B\n# another comment\nA > C\n", encoding="utf-8")
    assert Taxonomy.from_file(path).paths == ("A", "A > B", "A > C")
    with pytest.raises(TaxonomyError, match="not found"):
        Taxonomy.from_file(tmp_path / "missing.txt")
    path.write_text("A > B\n", encoding="utf-8")
    with pytest.raises(TaxonomyError, match="tax.txt"):
        Taxonomy.from_file(path)


def test_shipped_subset_shape() -> None:
    taxonomy = load_taxonomy()
    assert taxonomy is load_taxonomy(DEFAULT_TAXONOMY_PATH)  # cached
    leaves = taxonomy.leaves()
    assert 250 <= len(leaves) <= 600
    assert len(taxonomy.top_levels()) >= 15
    depths = Counter(taxonomy.depth(leaf) for leaf in leaves)
    assert sum(depths[d] for d in range(3, 7)) >= 0.9 * len(leaves)
    per_top = Counter(taxonomy.top_level(leaf) for leaf in leaves)
    assert min(per_top.values()) >= 5  # spread over the top levels
    with_siblings = [leaf for leaf in leaves if len(taxonomy.siblings(leaf)) >= 2]
    with_cousins = [
        leaf for leaf in leaves if any(taxonomy.is_leaf(c) for c in taxonomy.cousins(leaf))
    ]
    assert len(with_siblings) >= 0.9 * len(leaves)
    assert len(with_cousins) >= 0.5 * len(leaves)


def test_shipped_subset_carries_its_licence() -> None:
    folder = DEFAULT_TAXONOMY_PATH.parent
    header = DEFAULT_TAXONOMY_PATH.read_text(encoding="utf-8").splitlines()[0]
    assert header.startswith("#") and "Shopify" in header and "MIT" in header
    licence = (folder / "LICENSE").read_text(encoding="utf-8")
    assert "MIT License" in licence and "Copyright (c) Shopify Inc." in licence
    assert "github.com/Shopify/product-taxonomy" in licence


@pytest.mark.skipif(
    not FULL_TAXONOMY.exists(), reason="the full Shopify taxonomy is not on this machine"
)
def test_shipped_subset_is_part_of_the_full_taxonomy() -> None:
    full = set(Taxonomy.from_file(FULL_TAXONOMY).paths)
    assert set(load_taxonomy().paths) <= full
