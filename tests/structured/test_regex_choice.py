"""Regex and choice grammars under random logits."""

from __future__ import annotations

import re

from tests.structured.conftest import MODEL_VOCAB_SIZE
from tests.structured.decoding import HistoryModel, decode
from vlm_catalog.structured import GrammarSpec, GrammarState, choice_ebnf

SKU = r"[A-Z]{2,3}-\d{3,5}( \((new|used)\))?"

TRICKY_CHOICES = [
    'say "hi"',
    r"back\slash",
    "a|b (c)* [d]",
    "Café > Crème",
    "emoji 😀",
    "new",
    "new line\nafter",
    "tab\tafter",
]


def generate(service, tokenizer, spec, count, sampling="sample"):
    compiled = service.compile(spec)
    texts = []
    for seed in range(count):
        model = HistoryModel(tokenizer, MODEL_VOCAB_SIZE, seed=seed)
        state = GrammarState(compiled)
        decoded = decode(state, model, jump_forward=True, sampling=sampling, max_tokens=60)
        assert decoded.finished
        texts.append(tokenizer.decode(decoded.tokens))
    return texts


def test_regex_outputs_full_match(service, tokenizer):
    texts = generate(service, tokenizer, GrammarSpec.from_request(regex=SKU), 40)
    for text in texts:
        assert re.fullmatch(SKU, text), text
    assert len(set(texts)) > 20


def test_choice_outputs_exactly_one_option(service, tokenizer):
    texts = generate(service, tokenizer, GrammarSpec.from_request(choice=TRICKY_CHOICES), 80)
    assert set(texts) <= set(TRICKY_CHOICES)
    assert len(set(texts)) >= 4


def test_choice_with_prefix_options_needs_a_stop_or_more(service, tokenizer):
    state = GrammarState(service.compile(GrammarSpec.from_request(choice=["new", "new york"])))
    state.accept(tokenizer.encode("new", add_special_tokens=False))
    assert not state.is_finished()  # " york" may follow
    state.accept(tokenizer.encode(" york", add_special_tokens=False))
    assert state.is_finished()


def test_choice_ebnf_escapes_literals():
    assert choice_ebnf(['a"b', "c\\d"]) == 'root ::= ("a\\"b") | ("c\\\\d")'
