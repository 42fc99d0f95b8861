"""Greedy outputs of the engine equal transformers' `generate`, however the engine batches.

Each configuration exercises one engine mechanism (plain batching, chunked
prefill, preemption by recompute, prefix caching); the tokens must not change.
"""

import pytest

from tests.engine.conftest import mixed_conversations, transformers_generate
from vlm_catalog import LLM, SamplingParams

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def expected(engine_checkpoint, reference_model):
    from vlm_catalog.model.config import ModelConfig
    from vlm_catalog.preprocess.processor import PromptProcessor

    processor = PromptProcessor.from_pretrained(
        engine_checkpoint, image_token_id=ModelConfig.from_pretrained(engine_checkpoint).image_token_id
    )
    return [transformers_generate(reference_model, processor, m, MAX_TOKENS) for m in mixed_conversations()]


CONFIGS = {
    "batched": {},
    "every_prompt_chunked": {"max_num_batched_tokens": 16},
    # 3 tokens a step: prompts, images included, are cut into one- and two-token chunks beside decodes
    "three_token_budget": {"max_num_batched_tokens": 3},
    "prefix_caching_off": {"enable_prefix_caching": False},
    "shortest_prompt_first": {"scheduling_policy": "shortest_prompt_first", "max_num_seqs": 3},
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_equal_transformers(name, engine_checkpoint, expected):
    llm = LLM(engine_checkpoint, **CONFIGS[name])
    outputs = llm.chat(mixed_conversations(), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.finish_reason for o in outputs] == ["length"] * len(outputs)
    assert [o.token_ids for o in outputs] == expected
    stats = llm.engine.stats
    if name == "every_prompt_chunked":
        assert stats.num_steps > 20  # prompts of up to ~100 tokens in 16-token steps
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_prefix_cache_serves_a_shared_system_prompt(engine_checkpoint, reference_model):
    from tests.engine.conftest import conversation

    system = "You extract product metadata. " * 12
    conversations = [conversation(i, images=i % 2, words=4, system=system) for i in range(6)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    cached = LLM(engine_checkpoint, block_size=8)
    first = cached.chat(conversations[:1], params)
    rest = cached.chat(conversations[1:], params)
    hits = [o.metrics["num_cached_tokens"] for o in rest]
    assert first[0].metrics["num_cached_tokens"] == 0 and min(hits) >= 64
    uncached = LLM(engine_checkpoint, block_size=8, enable_prefix_caching=False)
    plain = uncached.chat(conversations, params)
    assert [o.token_ids for o in first + rest] == [o.token_ids for o in plain]
    assert cached.engine.stats.num_prompt_tokens_computed < uncached.engine.stats.num_prompt_tokens_computed


def test_preemption_by_recompute_keeps_the_tokens(engine_checkpoint, reference_model):
    from tests.engine.conftest import conversation
    from vlm_catalog.model.config import ModelConfig
    from vlm_catalog.preprocess.processor import PromptProcessor

    conversations = [conversation(i, words=2 + i) for i in range(6)]  # ~30-40 prompt tokens each
    processor = PromptProcessor.from_pretrained(
        engine_checkpoint, image_token_id=ModelConfig.from_pretrained(engine_checkpoint).image_token_id
    )
    expected = [transformers_generate(reference_model, processor, m, 48) for m in conversations]
    # 40 blocks of 4 tokens (2048 bytes each here): four prompts fit, but not while they grow by 48 tokens
    llm = LLM(engine_checkpoint, kv_cache_memory_bytes=40 * 2048, block_size=4, enable_prefix_caching=False)
    outputs = llm.chat(conversations, SamplingParams(max_tokens=48, ignore_eos=True))
    assert llm.engine.stats.num_preemptions > 0
    assert sum(o.metrics["num_preemptions"] for o in outputs) == llm.engine.stats.num_preemptions
    assert [o.token_ids for o in outputs] == expected
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
