"""Fixtures for constrained decoding: one tiny tokenizer and one compiler service per session."""

from __future__ import annotations

import random

import pytest

from vlm_catalog.data.synthetic.candidates import CandidateSampler
from vlm_catalog.data.taxonomy import load_taxonomy
from vlm_catalog.model.tiny_checkpoint import build_tokenizer
from vlm_catalog.structured import GrammarCompilerService

TOKENIZER_SIZE = 1000
MASK_SIZE = 1024  # the ids a grammar bitmask row covers: the tokenizer's, to a whole word of 32
MODEL_VOCAB_SIZE = 1088  # padded to a multiple of 64 past the bitmask words (1,024 ids), like Qwen's 151,936


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer(TOKENIZER_SIZE)


@pytest.fixture(scope="session")
def stop_token_ids(tokenizer) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(token) for token in ("<|im_end|>", "<|endoftext|>")]


@pytest.fixture(scope="session")
def service(tokenizer, stop_token_ids):
    with GrammarCompilerService(tokenizer, MODEL_VOCAB_SIZE, stop_token_ids, cache_size=512) as svc:
        yield svc


@pytest.fixture
def make_service(tokenizer, stop_token_ids):
    """A fresh service (own cache and counters), closed after the test."""
    created: list[GrammarCompilerService] = []

    def make(**options) -> GrammarCompilerService:
        svc = GrammarCompilerService(tokenizer, MODEL_VOCAB_SIZE, stop_token_ids, **options)
        created.append(svc)
        return svc

    yield make
    for svc in created:
        svc.close()


@pytest.fixture(scope="session")
def candidate_lists() -> list[list[str]]:
    """200 realistic candidate lists: 8-9 taxonomy leaves sharing prefixes with the truth."""
    taxonomy = load_taxonomy()
    sampler = CandidateSampler(taxonomy)
    rng = random.Random(1234)
    leaves = taxonomy.leaves()
    return [sampler.sample(rng.choice(leaves), rng) for _ in range(200)]
