"""Our engine loses no accuracy: the shipped model through it and through transformers `generate`.

Greedy decoding of the same weights and prompts, without and with each
record's grammar (xgrammar's transformers logits processor on the reference
side), must give the same answers, record by record.
"""

from __future__ import annotations

import json

import pytest

from vlm_catalog.data.loader import load_catalogue
from vlm_catalog.data.synthetic import make_catalog
from vlm_catalog.paths import DEFAULT_MODEL_DIR
from vlm_catalog.training.reference import engine_texts, transformers_texts

HELDOUT_SEED = 31337  # never used for training (see test_shipped_model.py)


@pytest.fixture(scope="module")
def heldout(tmp_path_factory) -> tuple[list, list]:
    """(records, labels) of 6 held-out records."""
    directory = make_catalog(tmp_path_factory.mktemp("reference") / "heldout", n=6, seed=HELDOUT_SEED)
    catalogue = load_catalogue(directory)
    return list(catalogue), catalogue.labels()


@pytest.mark.parametrize("constrained", [False, True], ids=["free", "constrained"])
def test_engine_answers_like_transformers_generate(heldout: tuple, constrained: bool) -> None:
    heldout_records, _ = heldout
    ours = engine_texts(DEFAULT_MODEL_DIR, heldout_records, constrained=constrained)
    theirs = transformers_texts(DEFAULT_MODEL_DIR, heldout_records, constrained=constrained)
    assert len(ours) == len(theirs) == len(heldout_records)
    for record, mine, reference in zip(heldout_records, ours, theirs):
        assert mine == reference, record.title
    if constrained:  # the grammar holds on both sides: every answer names one of its candidates
        for record, text in zip(heldout_records, theirs):
            assert json.loads(text)["category"] in record.candidate_categories



def test_reference_grammar_keeps_the_answer_among_the_candidates(heldout: tuple) -> None:
    # take the true category out of the candidates: the model's favourite is no longer allowed
    records, labels = heldout
    narrowed = [
        record.model_copy(update={"candidate_categories": [
            c for c in record.candidate_categories if c != label.category][:3]})
        for record, label in zip(records[:3], labels[:3])
    ]
    free = transformers_texts(DEFAULT_MODEL_DIR, narrowed, constrained=False)
    constrained = transformers_texts(DEFAULT_MODEL_DIR, narrowed, constrained=True)
    for record, text in zip(narrowed, constrained):
        assert json.loads(text)["category"] in record.candidate_categories
    # without the grammar the model does stray from them (else this test would prove nothing)
    assert any(_category(text) not in record.candidate_categories for record, text in zip(narrowed, free))


def _category(answer: str) -> str | None:
    try:
        return json.loads(answer)["category"]
    except (ValueError, KeyError, TypeError):
        return None
