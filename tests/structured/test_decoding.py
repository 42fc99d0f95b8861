"""Random-logits decoding: whatever the model prefers, finished answers are valid."""

from __future__ import annotations

import pytest

from schemas import ProductDetails, ProductMetadata
from tests.structured.conftest import MODEL_VOCAB_SIZE
from tests.structured.decoding import HistoryModel, decode
from vlm_catalog.structured import GrammarSpec, GrammarState, catalogue_schema

MIN_FINISHED_FRACTION = 0.95


def decode_answers(service, tokenizer, specs, sampling, seed_base):
    """Decode one answer per spec (jump-forward on); return (text, finished) pairs."""
    results = []
    for offset, spec in enumerate(specs):
        state = GrammarState(service.compile(spec))
        model = HistoryModel(tokenizer, MODEL_VOCAB_SIZE, seed=seed_base + offset)
        decoded = decode(state, model, jump_forward=True, sampling=sampling)
        results.append((tokenizer.decode(decoded.tokens), decoded.finished))
    return results


@pytest.mark.parametrize("sampling", ["greedy", "sample"])
@pytest.mark.parametrize("model_class", [ProductMetadata, ProductDetails])
def test_fixed_schema_answers_validate(service, tokenizer, model_class, sampling):
    spec = GrammarSpec.from_request(json_schema=model_class)
    results = decode_answers(service, tokenizer, [spec] * 40, sampling, seed_base=100)
    finished = [text for text, done in results if done]
    assert len(finished) >= MIN_FINISHED_FRACTION * len(results)
    for text in finished:
        model_class.model_validate_json(text)  # raises on an invalid answer
    assert len(set(finished)) > len(finished) // 2, "answers should vary with the seed"


@pytest.mark.parametrize("sampling", ["greedy", "sample"])
@pytest.mark.parametrize("base", [ProductMetadata, ProductDetails])
def test_catalogue_answers_pick_a_candidate(service, tokenizer, candidate_lists, base, sampling):
    lists = candidate_lists[:50]
    specs = [GrammarSpec.from_request(json_schema=catalogue_schema(c, base=base)) for c in lists]
    results = decode_answers(service, tokenizer, specs, sampling, seed_base=7000)
    finished = 0
    for candidates, spec, (text, done) in zip(lists, specs, results):
        if not done:
            continue
        finished += 1
        answer = base.model_validate_json(text)  # the benchmark's parse
        spec.output_schema.validate(text)  # JSON-schema validation, the enum included
        assert answer.category in candidates
    assert finished >= MIN_FINISHED_FRACTION * len(lists)
