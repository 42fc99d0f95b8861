"""Extraction when the model's context, not `max_tokens`, limits the answer.

`LLM.extract`, the batch runner and `POST /v1/extract` fit each record's budget
to what `max_model_len` leaves after its prompt (`LLMEngine.answer_room`). Where
that room holds an answer's fixed parts, the bounded schema still ends every
answer complete and valid; where it cannot, an answer the context cuts comes
with an error that names `max_model_len`, not `--max-tokens`.
"""

from __future__ import annotations

import json

import pytest

from schemas import ProductMetadata
from vlm_catalog.data.loader import CatalogueItem
from vlm_catalog.paths import SAMPLE_CATALOGUE_DIR
from vlm_catalog.structured.catalogue import MAX_TOKENS_PER_FREE_CHAR, token_counter

SPARE_TOKENS = 8  # the roomy record's room: its answer's reserve plus this, well below max_tokens 150


@pytest.fixture(scope="module")
def cases():
    """One sample record three ways under one `max_model_len`: as it is (room: its reserve plus
    `SPARE_TOKENS`), its description padded until the room is under half the shortest possible
    answer, and padded past `max_model_len`. Returns (items, rooms, the roomy record's brand
    bound, max_model_len)."""
    from vlm_catalog import LLM
    from vlm_catalog.data.loader import load_catalogue
    from vlm_catalog.preprocess.prompt import build_messages
    from vlm_catalog.structured.catalogue import answer_reserve

    record = load_catalogue(SAMPLE_CATALOGUE_DIR)[0]
    probe = LLM()
    try:
        count = token_counter(probe.tokenizer)

        def padded(words: int):
            return record.model_copy(update={"description": record.description + " sale" * words})

        def prompt_tokens(candidate) -> int:
            messages = build_messages(candidate, style="mlperf", schema=ProductMetadata)
            return probe.engine.processor.process(messages).num_tokens

        shortest_answer = min(
            count(json.dumps({"category": category, "brand": "", "is_secondhand": flag}, separators=(",", ":")))
            for category in record.candidate_categories for flag in (True, False)
        )
        first_prompt = prompt_tokens(record)
        reserve = answer_reserve(record.candidate_categories, count)
        max_model_len = first_prompt + reserve + SPARE_TOKENS
        low, high = 0, max_model_len  # the fewest padding words that leave at most half the shortest answer
        while low < high:
            middle = (low + high) // 2
            if max_model_len - prompt_tokens(padded(middle)) > shortest_answer // 2:
                low = middle + 1
            else:
                high = middle
        words = low
        cut, too_long = padded(words), padded(words + shortest_answer)
        rooms = {"roomy": max_model_len - first_prompt, "cut": max_model_len - prompt_tokens(cut),
                 "too long": max_model_len - prompt_tokens(too_long)}
    finally:
        probe.engine.close()
    assert 0 < rooms["cut"] <= shortest_answer // 2 and rooms["too long"] <= 0, rooms
    items = {name: CatalogueItem(index, candidate)
             for index, (name, candidate) in enumerate((("roomy", record), ("cut", cut), ("too long", too_long)))}
    brand_bound = (rooms["roomy"] - reserve) // MAX_TOKENS_PER_FREE_CHAR  # the bounded schema's, for that room
    return items, rooms, brand_bound, max_model_len


def test_llm_extract_and_the_batch_runner_fit_the_budget_to_the_context(cases):
    from vlm_catalog import LLM, SamplingParams
    from vlm_catalog.batch.local import run_items
    from vlm_catalog.batch.requests import RequestBuilder

    items, rooms, brand_bound, max_model_len = cases
    llm = LLM(max_model_len=max_model_len)
    try:
        roomy, cut, too_long = llm.extract([item.record for item in items.values()],
                                           sampling_params=SamplingParams(max_tokens=150))
        builder = RequestBuilder(ProductMetadata, "mlperf", 150, token_counter(llm.tokenizer))
        lines = []
        run_items(llm.engine, builder, items.values(), lines.append, window=4, read_ahead=2)
    finally:
        llm.engine.close()
    # the record the context leaves room for: complete and valid within that room (not 150 tokens),
    # by the bounded schema of that room
    assert roomy.ok and roomy.finish_reason == "stop" and roomy.metadata.category in items["roomy"].record.candidate_categories
    assert len(roomy.metadata.brand) <= brand_bound
    line = {line.id: line for line in lines}
    assert line["0"].failure is None and line["0"].response == roomy.text
    assert 0 < line["0"].num_tokens <= rooms["roomy"]
    # too little room for any answer: cut (after the bounded re-run), and the error says it was the context
    assert not cut.ok and cut.finish_reason == "length"
    assert f"max_model_len {max_model_len}" in cut.error and "filled the model's context" in cut.error, cut.error
    assert line["1"].failure == "length" and line["1"].num_tokens == rooms["cut"]
    assert f"max_model_len {max_model_len}" in line["1"].error and "--max-tokens" not in line["1"].error
    # a prompt past the context is refused as before
    assert too_long.finish_reason == "error" and "max_model_len" in too_long.error
    assert line["2"].failure == "engine" and "max_model_len" in line["2"].error


def test_the_service_fits_the_budget_to_the_context(cases):
    from tests.server.conftest import call, product_json
    from vlm_catalog.engine.async_engine import AsyncLLM
    from vlm_catalog.server import ServerSettings, create_app

    items, rooms, brand_bound, max_model_len = cases
    engine = AsyncLLM(max_model_len=max_model_len)
    try:
        app = create_app(engine, ServerSettings())
        roomy, cut, too_long = (call(app, "POST", "/v1/extract", json=product_json(item.record))
                                for item in items.values())
        assert call(app, "GET", "/health").status_code == 200
    finally:
        engine.shutdown()
    assert roomy.status_code == 200, roomy.text
    body = roomy.json()
    assert body["finish_reason"] == "stop" and "error" not in body
    metadata = ProductMetadata.model_validate(body["metadata"])
    assert metadata.category in items["roomy"].record.candidate_categories and len(metadata.brand) <= brand_bound
    assert body["usage"]["completion_tokens"] <= rooms["roomy"]
    assert cut.status_code == 200, cut.text
    body = cut.json()
    assert body["metadata"] is None and body["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == rooms["cut"]
    assert f"max_model_len {max_model_len}" in body["error"], body["error"]
    assert too_long.status_code == 400 and "max_model_len" in too_long.json()["error"]["message"]


def test_categories_with_special_token_text_fit_the_budget():
    """Such text is spelled with ordinary tokens in an answer (no grammar allows a special id
    there), and counted so: before, "<|im_end|>" counted as one token, the answer's reserve came
    out short, and the bounded schema's answer was cut at the budget ("length") even after its
    re-run, in LLM.extract, the batch job and the service alike; and a forced span (jump-forward)
    stopped at such text, leaving the model to spell it with still more tokens."""
    from vlm_catalog import LLM, SamplingParams
    from vlm_catalog.data.loader import load_catalogue

    record = load_catalogue(SAMPLE_CATALOGUE_DIR)[0]
    tricky = record.model_copy(update={"candidate_categories": ["Home > " + "<|im_end|>" * 10]})
    two = record.model_copy(update={"candidate_categories": ["Home > <|im_end|>", "Home > <|image_pad|><|vision_end|>"]})
    llm = LLM()
    try:
        count = token_counter(llm.tokenizer)
        assert count("<|im_end|>") > 1 and len(llm.tokenizer.encode("<|im_end|>", add_special_tokens=False)) == 1
        for max_tokens in (1, 20, 40):
            for product in (tricky, two):
                result = llm.extract([product], sampling_params=SamplingParams(max_tokens=max_tokens))[0]
                assert result.ok and result.metadata.category in product.candidate_categories, (max_tokens,
                                                                                                result.error)
        # a lone surrogate (JSON's "\ud800" escape) in a candidate fails its record alone: before, the
        # token count raised a TypeError out of the whole call, the other records' answers with it
        surrogate = record.model_copy(update={"candidate_categories": ["Home > Kitchen\ud800"]})
        good, bad = llm.extract([record, surrogate], sampling_params=SamplingParams(max_tokens=40))
        assert good.ok and not bad.ok and "unpaired surrogate" in bad.error
    finally:
        llm.engine.close()
