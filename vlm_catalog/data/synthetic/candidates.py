"""The candidate category list of a record: the truth among 7 or 8 confusable distractors.

Distractors come, in order of preference, from the truth's siblings (same
parent), its cousins (same grandparent), other leaves of its top-level
category, and finally anywhere in the taxonomy. All candidates are leaves.
"""

from __future__ import annotations

import random

from vlm_catalog.data.taxonomy import Taxonomy, TaxonomyError

CANDIDATE_COUNTS = (8, 9)


class CandidateSampler:
    """Draws candidate lists for the leaves of one taxonomy."""

    def __init__(self, taxonomy: Taxonomy) -> None:
        self._taxonomy = taxonomy
        self._leaves = taxonomy.leaves()
        self._leaf_set = frozenset(self._leaves)
        self._related_cache: dict[str, tuple[tuple[str, ...], ...]] = {}
        if len(self._leaves) < max(CANDIDATE_COUNTS):
            raise TaxonomyError(
                f"the taxonomy has {len(self._leaves)} leaves; candidate lists need "
                f"at least {max(CANDIDATE_COUNTS)}"
            )

    def _related(self, truth: str) -> tuple[tuple[str, ...], ...]:
        """(sibling leaves, cousin leaves, other leaves of the same top level) of `truth`."""
        if truth not in self._related_cache:
            self._related_cache[truth] = self._find_related(truth)
        return self._related_cache[truth]

    def _find_related(self, truth: str) -> tuple[tuple[str, ...], ...]:
        taxonomy = self._taxonomy
        siblings = tuple(p for p in taxonomy.siblings(truth) if p in self._leaf_set)
        cousins = tuple(p for p in taxonomy.cousins(truth) if p in self._leaf_set)
        near = {truth, *siblings, *cousins}
        same_top = tuple(p for p in taxonomy.leaves(taxonomy.top_level(truth)) if p not in near)
        return siblings, cousins, same_top

    def sample(self, truth: str, rng: random.Random) -> list[str]:
        """8 or 9 unique leaves, `truth` among them at a random position."""
        if truth not in self._leaf_set:
            raise TaxonomyError(f"{truth!r} is not a leaf category of the taxonomy")
        count = rng.choice(CANDIDATE_COUNTS)
        siblings, cousins, same_top = self._related(truth)
        distractors: list[str] = []
        distractors += rng.sample(siblings, min(len(siblings), rng.randint(2, 4)))
        distractors += rng.sample(cousins, min(len(cousins), rng.randint(1, 3)))
        distractors += rng.sample(same_top, min(len(same_top), rng.randint(1, 2)))
        distractors = distractors[: count - 1]
        chosen = {truth, *distractors}
        rest = [leaf for leaf in self._leaves if leaf not in chosen]
        distractors += rng.sample(rest, count - 1 - len(distractors))
        rng.shuffle(distractors)
        distractors.insert(rng.randrange(count), truth)
        return distractors
