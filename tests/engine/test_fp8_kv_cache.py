"""The engine with an FP8 (e4m3) KV cache against the same engine with its float32 cache."""

from __future__ import annotations

import pytest
import torch

from kernels import kv_cache
from schemas import ProductMetadata
from tests.engine.conftest import mixed_conversations
from vlm_catalog import LLM, SamplingParams
from vlm_catalog.engine.config import EngineConfig, EngineConfigError
from vlm_catalog.structured import catalogue_schema

# small blocks and steps: prefix reuse, chunked prefill and decode all read the FP8 cache
SMALL_STEPS = {"block_size": 4, "max_num_batched_tokens": 64}
GPU_SHARE = 0.3  # of the device for the profiled engine: `make test-gpu` runs on several workers


def _first_token_logprobs(llm, conversations):
    outputs = llm.chat(conversations, SamplingParams(max_tokens=1, logprobs=5, ignore_eos=True))
    return [output.logprobs[0] for output in outputs]


def test_fp8_engine_equals_a_float32_engine_that_caches_rounded_kv(engine_checkpoint, monkeypatch):
    """Reference: the float32 engine with every cached K/V rounded to e4m3 and widened back.
    The FP8 engine must give the same top-5 logprobs (tolerance 1e-5; measured equal): the
    only difference FP8 storage may make is that rounding, on every path that reads the cache."""
    conversations = mixed_conversations(8)
    fp8 = LLM(engine_checkpoint, kv_cache_dtype="fp8", **SMALL_STEPS)
    assert fp8.engine.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert fp8.engine.kv_caches[0][0].element_size() == 1
    got = _first_token_logprobs(fp8, conversations)
    fp8.engine.close()
    store = kv_cache.to_cache_dtype
    monkeypatch.setattr(kv_cache, "to_cache_dtype", lambda values, dtype: store(values, torch.float8_e4m3fn).to(dtype))
    emulated = LLM(engine_checkpoint, **SMALL_STEPS)
    assert emulated.engine.kv_caches[0][0].dtype == torch.float32
    expected = _first_token_logprobs(emulated, conversations)
    emulated.engine.close()
    for index, (want, have) in enumerate(zip(expected, got)):
        assert want.keys() == have.keys(), f"conversation {index}: other top-5 tokens"
        for token in want:
            assert abs(want[token] - have[token]) < 1e-5, f"conversation {index}, token {token}"


def test_constrained_answers_stay_valid_with_an_fp8_cache(engine_checkpoint):
    llm = LLM(engine_checkpoint, kv_cache_dtype="fp8", **SMALL_STEPS)
    candidates = ["Toys", "Tools > Drills", "Books"]
    schema = catalogue_schema(candidates).json_schema
    schema["properties"]["brand"]["maxLength"] = 8  # a random model seldom closes a free string
    for answer in llm.chat(mixed_conversations(8), SamplingParams(max_tokens=80, json_schema=schema)):
        assert answer.finish_reason == "stop", answer.error
        assert ProductMetadata.model_validate_json(answer.text).category in candidates
    llm.engine.close()


def test_unknown_kv_cache_dtype_is_a_config_error():
    with pytest.raises(EngineConfigError, match="kv_cache_dtype must be auto or fp8, fp8_e4m3; got 'int8'"):
        EngineConfig(kv_cache_dtype="int8")
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").torch_kv_cache_dtype == torch.float8_e4m3fn
    assert EngineConfig(device="cuda", kv_cache_dtype="auto").torch_kv_cache_dtype == torch.bfloat16
    with pytest.raises(EngineConfigError, match="quantization must be one of auto, fp8, fp8_w8a8, fp8_w8a8_channel, none; got 'int4'"):
        EngineConfig(quantization="int4")


@pytest.mark.gpu
@pytest.mark.xdist_group("gpu_memory")  # sizes its KV pool from the free device memory: one such test at a time
@pytest.mark.parametrize("quantization", ["auto", "fp8", "fp8_w8a8", "fp8_w8a8_channel"])
def test_fp8_engine_on_gpu_with_decode_graphs_answers_valid_json(engine_checkpoint, quantization):
    """The compiled kernels' FP8 paths end to end: prefill, decode CUDA graphs with the fused
    cache write, constrained sampling; with FP8 experts too, and with FP8 dense projections and
    FP8 GEMM inputs (`fp8_w8a8`, with blocks or per-channel scales). The KV pool comes from the
    memory profile (a share of the device, so the tests running beside it keep the rest)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    llm = LLM(engine_checkpoint, device="cuda", kv_cache_dtype="fp8", quantization=quantization,
              gpu_memory_utilization=GPU_SHARE, **SMALL_STEPS)
    assert llm.engine.kv_caches[0][0].dtype == torch.float8_e4m3fn and llm.engine.kv_caches[0][0].is_cuda
    experts = llm.engine.model.language_model.moe_experts()[0]
    assert (experts.gate_up_proj.dtype == torch.float8_e4m3fn) == (quantization != "auto")
    qkv = llm.engine.model.language_model.layers[0].self_attn.qkv_proj
    assert (qkv.weight.dtype == torch.float8_e4m3fn) == quantization.startswith("fp8_w8a8")
    assert llm.engine.runner.graph_runner is not None and llm.engine.runner.graph_runner.graphs
    candidates = ["Toys", "Tools > Drills", "Books"]
    schema = catalogue_schema(candidates).json_schema
    schema["properties"]["brand"]["maxLength"] = 8
    for answer in llm.chat(mixed_conversations(8), SamplingParams(max_tokens=80, json_schema=schema)):
        assert answer.finish_reason == "stop", answer.error
        assert ProductMetadata.model_validate_json(answer.text).category in candidates
    llm.engine.close()
