"""Scoring with padding of unparsable answers, baselines and attribute accuracy."""

import json

import pytest

from schemas import ProductDetails
from vlm_catalog.data.loader import RecordLabels
from vlm_catalog.evaluate.scoring import score

LABELS = [
    RecordLabels("A > B > C", "Acme", False, ["A > B > C", "A > B > D", "X > Y"]),
    RecordLabels("A > B > D", "Zed", True, ["A > B > C", "A > B > D"]),
    RecordLabels("X > Y", "Lumo", False, ["X > Y", "X > Z"]),
]


def answer(category, brand, secondhand, **extra):
    return json.dumps({"category": category, "brand": brand, "is_secondhand": secondhand, **extra})


def test_perfect_answers_score_one():
    responses = [(i, answer(truth.category, truth.brand, truth.is_secondhand)) for i, truth in enumerate(LABELS)]
    report = score(responses, LABELS)
    assert report.num_unparsable == 0
    assert report.category_hf1 == 1.0
    assert report.brand_accuracy == 1.0
    assert report.is_secondhand_f1 == 1.0
    assert report.attribute_accuracy is None


def test_unparsable_answers_are_padded_and_counted():
    responses = [
        (0, answer("A > B > C", "acme", False)),
        (1, "```json\n{}\n```"),  # fenced: unparsable
        (2, answer("X > Y", "Lumo", False, extra_key=1)),  # extra keys are forbidden
    ]
    report = score(responses, LABELS)
    assert report.num_unparsable == 2
    # padded categories match nothing and have the truth's depth: common 3, pred 3+3+2, true 3+3+2
    assert report.category_hierarchical_precision == pytest.approx(3 / 8)
    assert report.category_hierarchical_recall == pytest.approx(3 / 8)
    assert report.brand_accuracy == pytest.approx(1 / 3)
    assert len(report.unparsable_examples) == 2


def test_partial_category_credit():
    responses = [(0, answer("A > B > D", "Acme", False))]
    report = score(responses, LABELS)
    assert report.category_hf1 == pytest.approx(2 / 3)


def test_report_is_reproducible_for_a_seed_and_baselines_vary_with_it():
    responses = [(i % 3, "garbage") for i in range(60)]
    labels = LABELS
    first, second = score(responses, labels, seed=1), score(responses, labels, seed=1)
    assert first.to_dict() == second.to_dict()
    others = [score(responses, labels, seed=s).random_baseline for s in range(2, 8)]
    assert any(baseline != first.random_baseline for baseline in others)
    # random categories are drawn from the candidates, so the baseline is neither 0 nor 1
    assert 0.0 < first.random_baseline.category_hf1 < 1.0


def test_report_does_not_depend_on_the_order_of_the_file():
    # results files hold records in the order they finished; the random draws follow record order
    labels = LABELS * 10
    responses = [(i, "garbage" if i % 4 == 0 else answer(labels[i].category, "x", False)) for i in range(len(labels))]
    forward = score(responses, labels, seed=3)
    backward = score(list(reversed(responses)), labels, seed=3)
    assert forward.to_dict() == backward.to_dict()


def test_richer_schema_scores_attributes():
    attributes = {"colour": "red", "material": "wool", "target_gender": "female",
                  "age_group": "adult", "condition": "new"}
    labels = [RecordLabels("A > B > C", "Acme", False, ["A > B > C"], attributes)] * 2
    good = answer("A > B > C", "Acme", False, **attributes)
    wrong_colour = answer("A > B > C", "Acme", False, **{**attributes, "colour": "blue"})
    report = score([(0, good), (1, wrong_colour)], labels, answer_schema=ProductDetails)
    assert report.num_unparsable == 0
    assert report.attribute_accuracy["colour"] == 0.5
    assert report.attribute_accuracy["material"] == 1.0
    # the benchmark schema forbids the extra keys: same answers are unparsable there,
    # and it asks for no attributes, so none are scored
    benchmark = score([(0, good)], labels)
    assert benchmark.num_unparsable == 1 and benchmark.attribute_accuracy is None


def test_no_predictions_is_an_error():
    with pytest.raises(ValueError, match="no predictions"):
        score([], LABELS)
