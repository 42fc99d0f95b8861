"""The benchmark's accuracy metrics, as pure functions over (prediction, truth) pairs.

Definitions follow the MLPerf reference (`mlcommons/inference`,
`multimodal/qwen3-vl`, `evaluation.py`), restated in ../shared/docs/TASK.md:

- category: hierarchical F1, micro-aggregated over samples. Both paths are split
  on " > " and each level stripped; the per-sample intersection is the length of
  the longest common prefix of levels. hP = sum(prefix) / sum(len(pred)),
  hR = sum(prefix) / sum(len(true)), F1 = 2 hP hR / (hP + hR).
- brand: lower-cased and stripped; a prediction is correct when
  `rapidfuzz.fuzz.ratio(truth, pred) > 90`; reported as accuracy.
- is_secondhand: binary F1 with True as the positive class (0 when undefined,
  as scikit-learn's default `zero_division` gives).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rapidfuzz import fuzz

from schemas import CATEGORY_SEPARATOR

BRAND_MATCH_THRESHOLD = 90


def split_category(path: str, separator: str = CATEGORY_SEPARATOR) -> list[str]:
    """Levels of a category path, each stripped. An empty string is one empty level."""
    return [level.strip() for level in path.split(separator)]


def hierarchical_components(
    predicted: str, true: str, separator: str = CATEGORY_SEPARATOR
) -> tuple[int, int, int]:
    """(common-prefix length, predicted depth, true depth) for one sample."""
    predicted_levels = split_category(predicted, separator)
    true_levels = split_category(true, separator)
    common = 0
    for predicted_level, true_level in zip(predicted_levels, true_levels):
        if predicted_level != true_level:
            break
        common += 1
    return common, len(predicted_levels), len(true_levels)


@dataclass(frozen=True)
class HierarchicalScore:
    precision: float
    recall: float
    f1: float


def hierarchical_f1(
    pairs: Iterable[tuple[str, str]], separator: str = CATEGORY_SEPARATOR
) -> HierarchicalScore:
    """Micro-aggregated hierarchical precision, recall and F1 over (predicted, true) paths."""
    total_common = total_predicted = total_true = 0
    for predicted, true in pairs:
        common, predicted_depth, true_depth = hierarchical_components(predicted, true, separator)
        total_common += common
        total_predicted += predicted_depth
        total_true += true_depth
    precision = total_common / total_predicted if total_predicted else 0.0
    recall = total_common / total_true if total_true else 0.0
    f1 = 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)
    return HierarchicalScore(precision=precision, recall=recall, f1=f1)


def brand_matches(predicted: str, true: str) -> bool:
    return fuzz.ratio(true.strip().lower(), predicted.strip().lower()) > BRAND_MATCH_THRESHOLD


def brand_accuracy(pairs: Iterable[tuple[str, str]]) -> float:
    """Fraction of (predicted, true) brands that match fuzzily; 0.0 for no pairs."""
    matches = [brand_matches(predicted, true) for predicted, true in pairs]
    return sum(matches) / len(matches) if matches else 0.0


def binary_f1(pairs: Iterable[tuple[bool, bool]]) -> float:
    """F1 of the positive class (True) over (predicted, true) pairs; 0.0 when undefined."""
    true_positive = false_positive = false_negative = 0
    for predicted, true in pairs:
        if predicted and true:
            true_positive += 1
        elif predicted:
            false_positive += 1
        elif true:
            false_negative += 1
    denominator = 2 * true_positive + false_positive + false_negative
    return 2 * true_positive / denominator if denominator else 0.0
