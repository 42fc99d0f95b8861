"""Per-record schemas: the category can only be one of the record's candidates."""

from __future__ import annotations

import importlib.metadata

import jsonschema
import pytest
from packaging.version import Version

from schemas import AnswerValidationError, ProductDetails, ProductMetadata
from vlm_catalog.structured import GrammarError, GrammarSpec, GrammarState, catalogue_schema

CANDIDATES = [
    "Home & Garden > Lighting > Lamps",
    "Home & Garden > Lighting > Lamp Shades",
    "Home & Garden > Decor > Clocks",
    "Home & Garden > Lighting > Lamps",
]


def test_category_becomes_enum_rest_kept():
    restricted = catalogue_schema(CANDIDATES)
    assert restricted.name == "ProductMetadata"
    schema = restricted.json_schema
    base = ProductMetadata.model_json_schema()
    category = schema["properties"]["category"]
    assert category["enum"] == CANDIDATES[:3]  # deduplicated, order kept
    assert {k: v for k, v in category.items() if k != "enum"} == base["properties"]["category"]
    assert {k: v for k, v in schema.items() if k != "properties"} == {
        k: v for k, v in base.items() if k != "properties"
    }
    assert schema["additionalProperties"] is False
    assert list(schema["properties"]) == list(base["properties"])
    assert "enum" not in ProductMetadata.model_json_schema()["properties"]["category"]


def test_product_details_base_keeps_its_definitions():
    schema = catalogue_schema(CANDIDATES, base=ProductDetails).json_schema
    assert schema["properties"]["category"]["enum"] == CANDIDATES[:3]
    assert schema["$defs"] == ProductDetails.model_json_schema()["$defs"]


def test_validation_checks_the_enum():
    restricted = catalogue_schema(CANDIDATES)
    assert restricted.validate(answer(CANDIDATES[2]))["category"] == CANDIDATES[2]
    with pytest.raises(AnswerValidationError, match="is not one of"):
        restricted.validate(answer("Toys"))


def test_restricted_schema_is_itself_a_valid_json_schema():
    schema = catalogue_schema(CANDIDATES).json_schema
    jsonschema.validators.validator_for(schema).check_schema(schema)


@pytest.mark.parametrize(
    ("candidates", "message"),
    [
        ([], "candidate category list is empty"),
        ("Home & Garden", "must be a list of strings, got str"),
        (["Home & Garden", " "], "position 1 is blank"),
        (["Home & Garden", None], "position 1 is a NoneType"),
        (["Home & Garden", "Toys\ud800"], "position 1 has an unpaired surrogate '\\\\ud800' at character 4"),
    ],
)
def test_bad_candidate_lists(candidates, message):
    with pytest.raises(GrammarError, match=message):
        catalogue_schema(candidates)


def test_base_without_category():
    with pytest.raises(GrammarError, match="no 'category' property"):
        catalogue_schema(
            CANDIDATES, base={"type": "object", "properties": {"brand": {"type": "string"}}}
        )


def answer(category: str) -> str:
    return '{"category":"' + category + '","brand":"Lumo","is_secondhand":false}'


def test_grammar_admits_only_candidates(service, tokenizer):
    compiled = service.compile(GrammarSpec.from_request(json_schema=catalogue_schema(CANDIDATES)))
    state = GrammarState(compiled)
    state.accept(tokenizer.encode(answer(CANDIDATES[1]), add_special_tokens=False))
    assert state.is_finished()
    wrong_categories = [
        "Home & Garden > Lighting",  # a prefix of a candidate
        "Home & Garden > Lighting > Lamps > Desk Lamps",  # a candidate extended
        "Toys",  # invented
    ]
    for wrong in wrong_categories:
        tokens = tokenizer.encode(answer(wrong), add_special_tokens=False)
        with pytest.raises(GrammarError, match="not allowed"):
            GrammarState(compiled).accept(tokens)


@pytest.mark.parametrize("base", [ProductMetadata, ProductDetails])
@pytest.mark.parametrize("max_tokens", [12, 40, 150])
def test_budgeted_schema_ends_every_answer_within_the_budget(service, tokenizer, base, max_tokens):
    """A model that never wants to close the brand still gets a complete, valid answer in budget."""
    from tests.structured.conftest import MODEL_VOCAB_SIZE
    from tests.structured.decoding import HistoryModel, decode
    from vlm_catalog.structured.catalogue import budgeted_catalogue_schema

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    schema, budget = budgeted_catalogue_schema(CANDIDATES, max_tokens, count, base)
    assert budget >= max_tokens and (budget == max_tokens or "{0,0}" in schema.json_schema["properties"]["brand"]["pattern"])
    compiled = service.compile(GrammarSpec.from_request(json_schema=schema))
    for seed in range(4):
        model = HistoryModel(tokenizer, MODEL_VOCAB_SIZE, seed=seed, close_bias=0.0)
        decoded = decode(GrammarState(compiled), model, jump_forward=seed % 2 == 0, sampling="sample",
                         max_tokens=budget)
        assert decoded.finished, (seed, tokenizer.decode(decoded.tokens))
        answer = base.model_validate_json(tokenizer.decode(decoded.tokens))
        assert answer.category in CANDIDATES
        schema.validate(tokenizer.decode(decoded.tokens))


def byte_tokens(tokenizer, raw: bytes) -> list[int]:
    """One byte-level BPE token per byte (GPT-2's byte-to-character map), whatever the bytes decode to."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    character = {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}
    return [tokenizer.convert_tokens_to_ids(character[b]) for b in raw]


def test_budgeted_free_text_takes_unicode_characters_only(service, tokenizer):
    """The bounded brand's characters are Unicode scalar values: before, the grammar also took the
    UTF-8-style bytes of a surrogate (ED A0 80) and an overlong NUL (E0 80 80), each decoding to
    three U+FFFD, so a finished answer broke its own length bound and failed its schema."""
    from vlm_catalog.structured.catalogue import budgeted_catalogue_schema

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    schema, _ = budgeted_catalogue_schema(CANDIDATES, 40, count)
    compiled = service.compile(GrammarSpec.from_request(json_schema=schema))
    opening = tokenizer.encode('{"category":"' + CANDIDATES[0] + '","brand":"', add_special_tokens=False)
    for good in ("é", "\U0001F389", "\ue000", "a"):
        state = GrammarState(compiled)
        state.accept(opening + byte_tokens(tokenizer, good.encode()))
        state.accept(tokenizer.encode('","is_secondhand":true}', add_special_tokens=False))
        assert state.is_finished()
        schema.validate(tokenizer.decode(opening) + good + '","is_secondhand":true}')
    # a surrogate, past U+10FFFF, an escape, a control character; and overlong forms, which
    # xgrammar 0.1 (the declared floor, 0.1.33) still takes in any character class
    bad_bytes = [b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\\", b"\x01"]
    if Version(importlib.metadata.version("xgrammar")) >= Version("0.2"):
        bad_bytes += [b"\xe0\x80\x80", b"\xc0\x80"]
    for bad in bad_bytes:
        with pytest.raises(GrammarError, match="not allowed"):
            GrammarState(compiled).accept(opening + byte_tokens(tokenizer, bad))


def test_record_schema_bounds_only_tight_budgets_or_reruns():
    from vlm_catalog.structured.catalogue import answer_reserve, record_schema

    def count(text: str) -> int:
        return len(text.encode()) // 3 + 1  # any monotone token count will do here

    reserve = answer_reserve(CANDIDATES, count)
    plain, budget, bounded = record_schema(CANDIDATES, reserve + 200, count)
    assert not bounded and budget == reserve + 200 and "pattern" not in plain.json_schema["properties"]["brand"]
    rerun, _, bounded = record_schema(CANDIDATES, reserve + 200, count, bounded=True)
    assert bounded and "pattern" in rerun.json_schema["properties"]["brand"]
    tight, budget, bounded = record_schema(CANDIDATES, 5, count)
    assert bounded and budget == reserve and "{0,0}" in tight.json_schema["properties"]["brand"]["pattern"]


def test_record_schema_fits_the_budget_to_what_the_context_leaves():
    """`answer_room` (max_model_len minus the prompt) caps the budget, so the bounded schema's
    guarantee holds against the context too. Below the answer's fixed parts nothing can be
    guaranteed: the whole room, the plain schema first, the bounded one (empty brand) to re-run."""
    from vlm_catalog.structured.catalogue import answer_reserve, record_schema

    def count(text: str) -> int:
        return len(text.encode()) // 3 + 1

    reserve = answer_reserve(CANDIDATES, count)
    _, budget, bounded = record_schema(CANDIDATES, reserve + 200, count, answer_room=reserve + 1000)
    assert not bounded and budget == reserve + 200  # room to spare: max_tokens rules
    plain, budget, bounded = record_schema(CANDIDATES, reserve + 200, count, answer_room=reserve + 100)
    assert not bounded and budget == reserve + 100 and "pattern" not in plain.json_schema["properties"]["brand"]
    tight, budget, bounded = record_schema(CANDIDATES, reserve + 200, count, answer_room=reserve + 9)
    assert bounded and budget == reserve + 9  # tight against the context: bounded at once, within the room
    assert "{0,2}" in tight.json_schema["properties"]["brand"]["pattern"]  # 9 tokens // 4 per character
    rerun, budget, bounded = record_schema(CANDIDATES, reserve + 200, count, bounded=True, answer_room=reserve + 100)
    assert bounded and budget == reserve + 100 and "{0,25}" in rerun.json_schema["properties"]["brand"]["pattern"]
    for max_tokens in (150, 5):  # a room below the reserve: all of it, even above a tiny max_tokens
        plain, budget, bounded = record_schema(CANDIDATES, max_tokens, count, answer_room=reserve - 3)
        assert not bounded and budget == reserve - 3 and "pattern" not in plain.json_schema["properties"]["brand"]
        rerun, budget, bounded = record_schema(CANDIDATES, max_tokens, count, bounded=True, answer_room=reserve - 3)
        assert bounded and budget == reserve - 3 and "{0,0}" in rerun.json_schema["properties"]["brand"]["pattern"]


def test_special_token_text_counts_as_the_ordinary_text_an_answer_spells():
    """`token_counter` reads "<|im_end|>" as text (an answer cannot use the special id), on its own
    copy of the tokenizer: transformers' split_special_tokens flips a flag on the shared tokenizer
    at each call, which raced with the threads tokenising prompts (a prompt with an image then had
    0 image placeholders)."""
    from transformers import AutoTokenizer

    from vlm_catalog.paths import DEFAULT_MODEL_DIR
    from vlm_catalog.structured.catalogue import token_counter

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    tokenizer("a long text of many words to cut", truncation=True, max_length=3)  # leaves the backend truncating
    count = token_counter(tokenizer)  # its copy must not keep that
    assert count("a long text of many words to cut") == len(tokenizer.encode("a long text of many words to cut",
                                                                            add_special_tokens=False))
    counted = count("Home > <|im_end|>")
    assert tokenizer.backend_tokenizer.encode_special_tokens is False  # the shared tokenizer untouched
    assert tokenizer.encode("<|image_pad|>", add_special_tokens=False) == [tokenizer.convert_tokens_to_ids("<|image_pad|>")]
    assert count("Home > Kitchen") == len(tokenizer.encode("Home > Kitchen", add_special_tokens=False))
    spelled = tokenizer("Home > <|im_end|>", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert counted == len(spelled) > len(tokenizer.encode("Home > <|im_end|>", add_special_tokens=False))
