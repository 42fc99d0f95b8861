"""Score predictions against a labelled catalogue with the benchmark's metric.

As in the MLPerf reference, a response that does not validate against the
answer schema is replaced by a padded answer: a category of pad levels (as deep
as the truth, matching nothing), a pad brand and a random `is_secondhand`. The
random-guess baselines pick a random candidate category, a random
`is_secondhand` and a random brand among the scored records' true brands.

Randomness comes from one `numpy.random.default_rng(seed)` consumed in record
order, so a report is reproducible for a seed. (The reference splits its work
over processes with per-chunk seeds; its random draws, and so its baselines
and padded `is_secondhand` values, depend on the CPU count. Every other number
is the same.)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError

from schemas import ATTRIBUTE_FIELDS, CATEGORY_SEPARATOR, ProductMetadata
from vlm_catalog.data.loader import RecordLabels
from vlm_catalog.evaluate.metrics import binary_f1, brand_accuracy, hierarchical_f1

CATEGORY_PAD = "<|__PRED_CATEGORY_PAD__|>"
BRAND_PAD = "<|__PRED_BRAND_PAD__|>"
DEFAULT_SEED = 12345


@dataclass(frozen=True)
class BaselineScores:
    category_hf1: float
    brand_accuracy: float
    is_secondhand_f1: float

    def as_row(self) -> tuple[float, float, float]:
        return self.category_hf1, self.brand_accuracy, self.is_secondhand_f1


@dataclass
class AccuracyReport:
    """Accuracy of one prediction set. `to_dict` gives the `--json` output."""

    num_samples: int
    num_unparsable: int
    category_hf1: float
    category_hierarchical_precision: float
    category_hierarchical_recall: float
    brand_accuracy: float
    is_secondhand_f1: float
    random_baseline: BaselineScores
    attribute_accuracy: dict[str, float] | None = None
    seed: int = DEFAULT_SEED
    unparsable_examples: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format_table(self) -> str:
        rows = [
            ("predictions", self.category_hf1, self.brand_accuracy, self.is_secondhand_f1),
            ("random guess", *self.random_baseline.as_row()),
        ]
        header = f"{'':<14}{'category hF1':>14}{'brand acc':>12}{'2nd-hand F1':>13}"
        lines = [header, "-" * len(header)]
        lines += [f"{name:<14}{c:>14.4f}{b:>12.4f}{s:>13.4f}" for name, c, b, s in rows]
        lines.append(
            f"samples: {self.num_samples}   unparsable responses: {self.num_unparsable}   "
            f"hierarchical P/R: {self.category_hierarchical_precision:.4f}/"
            f"{self.category_hierarchical_recall:.4f}"
        )
        if self.attribute_accuracy:
            cells = "   ".join(f"{name} {value:.4f}" for name, value in self.attribute_accuracy.items())
            lines.append(f"attribute exact match: {cells}")
        return "\n".join(lines)


def score(
    responses: Sequence[tuple[int, str]],
    labels: Sequence[RecordLabels],
    seed: int = DEFAULT_SEED,
    answer_schema: type[BaseModel] = ProductMetadata,
    max_unparsable_examples: int = 5,
) -> AccuracyReport:
    """Score (record index, raw response) pairs against the catalogue's labels.

    `answer_schema` parses each response; it must have `category`, `brand` and
    `is_secondhand` fields (the benchmark uses `ProductMetadata`, which forbids
    extra keys).
    """
    if not responses:
        raise ValueError("no predictions to score")
    # in record order: the random draws, and so the report, do not depend on the order of the
    # file (an extract run writes records as they finish, an accuracy log in completion order)
    responses = sorted(responses, key=lambda pair: pair[0])
    rng = np.random.default_rng(seed)
    category_pairs: list[tuple[str, str]] = []
    brand_pairs: list[tuple[str, str]] = []
    secondhand_pairs: list[tuple[bool, bool]] = []
    random_category_pairs: list[tuple[str, str]] = []
    random_secondhand_pairs: list[tuple[bool, bool]] = []
    # attributes are scored only when the answer schema asks for them (e.g. ProductDetails)
    attribute_names = [name for name in ATTRIBUTE_FIELDS if name in answer_schema.model_fields]
    attribute_hits: dict[str, list[bool]] = {name: [] for name in attribute_names}
    unparsable_examples: list[dict[str, Any]] = []
    num_unparsable = 0

    for index, response in responses:
        truth = labels[index]
        try:
            answer = answer_schema.model_validate_json(response)
            category, brand, is_secondhand = answer.category, answer.brand, answer.is_secondhand
        except ValidationError as exc:
            num_unparsable += 1
            depth = len(truth.category.split(CATEGORY_SEPARATOR))
            category = CATEGORY_SEPARATOR.join([CATEGORY_PAD] * depth)
            brand = BRAND_PAD
            is_secondhand = bool(rng.choice([True, False]))
            if len(unparsable_examples) < max_unparsable_examples:
                unparsable_examples.append(
                    {"index": index, "response": response[:500], "error": exc.errors()[0]["msg"]}
                )
        category_pairs.append((category, truth.category))
        brand_pairs.append((brand, truth.brand))
        secondhand_pairs.append((is_secondhand, truth.is_secondhand))
        random_category_pairs.append((str(rng.choice(truth.candidates)), truth.category))
        random_secondhand_pairs.append((bool(rng.choice([True, False])), truth.is_secondhand))
        if truth.attributes is not None and attribute_names:
            given = _loose_json_object(response)
            for name in attribute_names:
                attribute_hits[name].append(given.get(name) == truth.attributes.get(name))

    all_brands = sorted({labels[index].brand for index, _ in responses})
    random_brands = rng.choice(all_brands, size=len(responses))
    random_brand_pairs = [
        (str(random_brand), labels[index].brand)
        for random_brand, (index, _) in zip(random_brands, responses)
    ]
    category_score = hierarchical_f1(category_pairs)
    attribute_accuracy = {
        name: sum(hits) / len(hits) for name, hits in attribute_hits.items() if hits
    } or None
    return AccuracyReport(
        num_samples=len(responses),
        num_unparsable=num_unparsable,
        category_hf1=category_score.f1,
        category_hierarchical_precision=category_score.precision,
        category_hierarchical_recall=category_score.recall,
        brand_accuracy=brand_accuracy(brand_pairs),
        is_secondhand_f1=binary_f1(secondhand_pairs),
        random_baseline=BaselineScores(
            category_hf1=hierarchical_f1(random_category_pairs).f1,
            brand_accuracy=brand_accuracy(random_brand_pairs),
            is_secondhand_f1=binary_f1(random_secondhand_pairs),
        ),
        attribute_accuracy=attribute_accuracy,
        seed=seed,
        unparsable_examples=unparsable_examples,
    )


def _loose_json_object(text: str) -> dict[str, Any]:
    """The response as a JSON object if it is one, else an empty dict (for attribute scoring)."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return {}
    return value if isinstance(value, dict) else {}
