"""The benchmark metric functions against hand-computed cases."""

import pytest

from vlm_catalog.evaluate.metrics import (
    binary_f1,
    brand_accuracy,
    brand_matches,
    hierarchical_components,
    hierarchical_f1,
)

TRUE = "A > B > C > D"


@pytest.mark.parametrize(
    ("predicted", "expected"),
    [
        ("A > B > C > D", (4, 4, 4)),  # exact
        ("A > B > X > D", (2, 4, 4)),  # diverges at level 3: later matches don't count
        ("A > B", (2, 2, 4)),  # shallower prediction, a prefix of the truth
        ("A > B > C > D > E > F", (4, 6, 4)),  # deeper prediction
        ("X > B > C > D", (0, 4, 4)),  # wrong root
        ("", (0, 1, 4)),  # empty string is one empty level
        ("A>B>C>D", (0, 1, 4)),  # not split: the separator is " > " with spaces
        ("A  >  B > C > D", (4, 4, 4)),  # levels are stripped
    ],
)
def test_hierarchical_components(predicted, expected):
    assert hierarchical_components(predicted, TRUE) == expected


def test_hierarchical_f1_is_micro_aggregated():
    pairs = [("A > B > C > D", TRUE), ("A > B", TRUE), ("A > B > X > Y > Z", "A > B > X")]
    # common: 4 + 2 + 3 = 9; predicted depth: 4 + 2 + 5 = 11; true depth: 4 + 4 + 3 = 11
    score = hierarchical_f1(pairs)
    assert score.precision == pytest.approx(9 / 11)
    assert score.recall == pytest.approx(9 / 11)
    assert score.f1 == pytest.approx(9 / 11)


def test_hierarchical_f1_precision_and_recall_differ():
    # common 2, predicted 2, true 4 -> P = 1, R = 0.5, F1 = 2/3
    score = hierarchical_f1([("A > B", TRUE)])
    assert (score.precision, score.recall, score.f1) == pytest.approx((1.0, 0.5, 2 / 3))


def test_hierarchical_f1_all_wrong_and_empty():
    assert hierarchical_f1([("X", TRUE)]).f1 == 0.0
    assert hierarchical_f1([]).f1 == 0.0


def test_brand_matching_is_fuzzy_case_and_space_insensitive():
    assert brand_matches("  GIORGIO ARMANI ", "giorgio armani")
    assert brand_matches("Adidas", "adidas")
    assert not brand_matches("Adodas", "adidas")  # ratio 83.3 <= 90
    assert brand_matches("giorgio armanii", "giorgio armani")  # ratio 96.6 > 90
    assert not brand_matches("", "acme")
    assert brand_accuracy([("Acme", "acme"), ("Zed", "Zed Clothing"), ("x", "y"), ("Lumo", "lumo")]) == 0.5
    assert brand_accuracy([]) == 0.0


def test_binary_f1_positive_class_true():
    pairs = [(True, True), (True, False), (False, True), (False, False), (True, True)]
    # TP 2, FP 1, FN 1 -> F1 = 4 / 6
    assert binary_f1(pairs) == pytest.approx(2 / 3)
    assert binary_f1([(False, False)]) == 0.0  # undefined -> 0, as scikit-learn reports
    assert binary_f1([(True, True)]) == 1.0
