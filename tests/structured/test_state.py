"""GrammarState: accept/rollback, forced spans, masks, finishing."""

from __future__ import annotations

import json
import re

import pytest
import torch
import xgrammar as xgr

from schemas import ProductMetadata
from tests.structured.conftest import MASK_SIZE, MODEL_VOCAB_SIZE, TOKENIZER_SIZE
from tests.structured.decoding import HistoryModel
from vlm_catalog.structured import (
    GrammarError,
    GrammarSpec,
    GrammarState,
    allocate_bitmask,
    apply_bitmask,
    catalogue_schema,
)
from vlm_catalog.structured.bitmask import row_token_ids

ANSWER = {"category": "Home & Garden > Lighting > Lamps", "brand": "Lumo", "is_secondhand": True}


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture
def catalogue_compiled(service, candidate_lists):
    candidates = candidate_lists[0] + [ANSWER["category"]]
    return service.compile(GrammarSpec.from_request(json_schema=catalogue_schema(candidates)))


def walk_with_reference(compiled, tokenizer, seed: int, steps: int = 80):
    """Yield (state, jump-forward string of an independent xgrammar matcher) along a random walk."""
    state = GrammarState(compiled)
    reference = xgr.GrammarMatcher(compiled.grammar)
    model = HistoryModel(tokenizer, MODEL_VOCAB_SIZE, seed=seed)
    bitmask = allocate_bitmask(1, MASK_SIZE)
    tokens: list[int] = []
    for _ in range(steps):
        if state.is_finished():
            return
        yield state, reference.find_jump_forward_string()
        logits = model.logits(tokens)
        state.fill_bitmask(bitmask, 0)
        apply_bitmask(logits, bitmask, [0])
        token = int(logits.argmax())
        state.accept([token])
        assert reference.accept_token(token)
        tokens.append(token)


def test_forced_tokens_are_canonical_prefix_without_boundary(catalogue_compiled, tokenizer):
    seen_forced = 0
    for seed in range(5):
        for state, forced_text in walk_with_reference(catalogue_compiled, tokenizer, seed):
            forced = state.forced_tokens()
            canonical = encode(tokenizer, forced_text) if forced_text else []
            assert len(forced) <= max(len(canonical) - 1, 0)  # never the boundary token
            assert forced == canonical[: len(forced)]
            if forced:
                seen_forced += 1
                assert forced[0] in state.allowed_token_ids()
    assert seen_forced > 20


def test_forced_tokens_are_accepted_and_plan_continues(catalogue_compiled, tokenizer):
    state = GrammarState(catalogue_compiled)
    forced = state.forced_tokens()
    assert tokenizer.decode(forced) == '{"category":'
    state.accept(forced[:1])
    assert state.forced_tokens() == forced[1:]  # the plan, not a re-tokenisation
    state.accept(forced[1:])
    assert state.forced_tokens() == []  # the boundary token is the model's choice
    boundary = encode(tokenizer, '{"category":"')[-1]
    assert boundary in state.allowed_token_ids()


def test_single_token_forced_string_forces_nothing(service, tokenizer):
    assert len(encode(tokenizer, "brand")) == 1
    state = GrammarState(service.compile(GrammarSpec.from_request(regex="brand")))
    assert state.forced_tokens() == []
    assert state.allowed_token_ids() != []


def test_force_canonical_mask_allows_only_the_next_forced_token(catalogue_compiled):
    state = GrammarState(catalogue_compiled)
    bitmask = allocate_bitmask(2, MASK_SIZE)
    state.fill_bitmask(bitmask, 1, force_canonical=True)
    assert row_token_ids(bitmask[1], MASK_SIZE) == state.forced_tokens()[:1]
    untouched = row_token_ids(bitmask[0], MASK_SIZE)
    assert untouched == list(range(MASK_SIZE))
    state.fill_bitmask(bitmask, 1)
    assert len(row_token_ids(bitmask[1], MASK_SIZE)) >= 1


def test_padded_and_special_ids_never_allowed(catalogue_compiled, tokenizer, stop_token_ids):
    special = set(tokenizer.all_special_ids) - set(stop_token_ids)
    for seed in range(3):
        for state, _ in walk_with_reference(catalogue_compiled, tokenizer, seed):
            allowed = state.allowed_token_ids()
            assert allowed and max(allowed) < TOKENIZER_SIZE
            assert not special & set(allowed)
    state = GrammarState(catalogue_compiled)
    with pytest.raises(GrammarError, match="1010 .vocabulary padding"):
        state.accept([1010])
    state.accept(encode(tokenizer, '{"category":"Home & Garden > Lighting > Lamps","brand":"'))
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    with pytest.raises(GrammarError, match=re.escape("'<|image_pad|>', a special token")):
        state.accept([image_pad])  # its literal text would be valid inside the string


def test_rejected_token_leaves_state_unchanged(service, tokenizer):
    state = GrammarState(service.compile(GrammarSpec.from_request(json_schema=ProductMetadata)))
    good = encode(tokenizer, '{"category":"Toys"')
    state.accept(good[:2])
    forced_before = state.forced_tokens()
    expected = "not allowed by the json_schema 'ProductMetadata' grammar after 2 tokens"
    with pytest.raises(GrammarError, match=expected):
        state.accept(good[2:] + encode(tokenizer, "}"))
    assert state.num_accepted == 2
    assert state.forced_tokens() == forced_before
    state.accept(good[2:])


def test_rollback_restores_matcher_and_plan(catalogue_compiled):
    state = GrammarState(catalogue_compiled)
    plan = state.forced_tokens()
    state.accept(plan[:2])
    state.rollback(2)
    assert state.num_accepted == 0
    assert state.forced_tokens() == plan
    state.accept(plan)
    state.rollback(1)
    assert state.forced_tokens() == plan[-1:]
    with pytest.raises(GrammarError, match="cannot roll back 9 tokens"):
        state.rollback(9)


def test_finished_without_stop_token(service, tokenizer, stop_token_ids):
    state = GrammarState(service.compile(GrammarSpec.from_request(json_schema=ProductMetadata)))
    body = encode(tokenizer, json.dumps(ANSWER, separators=(",", ":")))
    state.accept(body[:-1])
    assert not state.is_finished()
    state.accept(body[-1:])
    assert state.is_finished() and not state.is_terminated()
    assert sorted(state.allowed_token_ids()) == sorted(stop_token_ids)
    state.accept([stop_token_ids[0]])
    assert state.is_terminated() and state.is_finished()
    assert state.forced_tokens() == [] and state.allowed_token_ids() == []
    with pytest.raises(GrammarError, match="has terminated"):
        state.fill_bitmask(allocate_bitmask(1, MASK_SIZE), 0)


def test_complete_but_extendable_is_not_finished(service, tokenizer):
    state = GrammarState(service.compile(GrammarSpec.from_request(regex="[a-z]+")))
    state.accept(encode(tokenizer, "lamp"))
    assert not state.is_finished()


def test_inside_a_multibyte_character_forces_nothing(service, tokenizer):
    schema = {"enum": ["Café Alpha", "Café Beta"]}
    state = GrammarState(service.compile(GrammarSpec.from_request(json_schema=schema)))
    state.accept(encode(tokenizer, '"Caf'))
    first_byte_of_e_acute = tokenizer.convert_tokens_to_ids("Ã")  # byte 0xC3 in byte-level BPE
    state.accept([first_byte_of_e_acute])
    assert state.forced_tokens() == []
    assert state.allowed_token_ids()


def test_apply_bitmask_on_logits_masks_padding(catalogue_compiled):
    state = GrammarState(catalogue_compiled)
    bitmask = allocate_bitmask(1, MASK_SIZE)
    state.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, MODEL_VOCAB_SIZE)
    apply_bitmask(logits, bitmask, [0])
    finite = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert finite == state.allowed_token_ids()
    assert torch.isinf(logits[0, TOKENIZER_SIZE:]).all()  # the blanked ids and the padding past the bitmask


def test_a_bitmask_of_the_logits_width_is_refused_clearly(catalogue_compiled):
    """Grammar rows cover the tokenizer's ids only (xgrammar walks every id of its table on each
    fill and accept, padding included); a bitmask as wide as the logits is a clear error."""
    from vlm_catalog.structured import BitmaskFiller

    state = GrammarState(catalogue_compiled)
    assert state.mask_size == MASK_SIZE < MODEL_VOCAB_SIZE
    wide = allocate_bitmask(1, MODEL_VOCAB_SIZE)
    with pytest.raises(ValueError, match=r"int32 \[B, 32\] \(the tokenizer's 1024 ids"):
        state.fill_bitmask(wide, 0)
    with pytest.raises(ValueError, match=r"allocate_bitmask\(B, vocabulary.mask_size\)"):
        BitmaskFiller().fill([state], [0], wide)


def test_bitmask_filler_writes_what_each_state_would(catalogue_compiled, tokenizer):
    """A batch of states at different points of their answers (some inside a forced span),
    in scattered rows: the parallel fill equals row-by-row `fill_bitmask`, both modes."""
    from vlm_catalog.structured import BitmaskFiller

    states = []
    for seed in range(12):
        state = GrammarState(catalogue_compiled)
        model = HistoryModel(tokenizer, MODEL_VOCAB_SIZE, seed=seed)
        scratch = allocate_bitmask(1, MASK_SIZE)
        tokens: list[int] = []
        for _ in range(seed * 3):  # seed 0 at the start, seed 11 deep into the answer
            if state.is_finished():
                break
            logits = model.logits(tokens)
            state.fill_bitmask(scratch, 0)
            apply_bitmask(logits, scratch, [0])
            tokens.append(int(logits.argmax()))
            state.accept(tokens[-1:])
        if not state.is_terminated():
            states.append(state)
    assert len(states) >= 8
    assert any(state.forced_tokens() for state in states)  # the forced-span path is exercised
    rows = [2 * i + 1 for i in range(len(states))]  # not 0..n-1: rows are passed through
    filler = BitmaskFiller(max_threads=2)
    for force_canonical in (False, True):
        batched = allocate_bitmask(2 * len(states) + 1, MASK_SIZE)
        filler.fill(states, rows, batched, force_canonical=force_canonical)
        one_by_one = allocate_bitmask(2 * len(states) + 1, MASK_SIZE)
        for state, row in zip(states, rows):
            state.fill_bitmask(one_by_one, row, force_canonical=force_canonical)
        assert torch.equal(batched, one_by_one)
        assert (batched[0] == -1).all()  # rows not listed stay untouched (all allowed)
    with pytest.raises(ValueError, match="2 grammar states for 1 rows"):
        filler.fill(states[:2], rows[:1], batched)


def test_bitmask_filler_refuses_a_terminated_grammar(service, tokenizer, stop_token_ids):
    from vlm_catalog.structured import BitmaskFiller

    state = GrammarState(service.compile(GrammarSpec.from_request(choice=("yes", "no"))))
    state.accept(encode(tokenizer, "yes") + [stop_token_ids[0]])
    assert state.is_terminated()
    with pytest.raises(GrammarError, match="has terminated"):
        BitmaskFiller().fill([state], [0], allocate_bitmask(1, MASK_SIZE))
