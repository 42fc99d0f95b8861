"""The start-up warm-up (engine/warmup.py): which step sizes it runs, and that it leaves the
engine as if just started, answering exactly as an engine without it."""

import pytest

from kernels.moe.configs import TOKEN_BUCKETS, token_bucket
from tests.engine.conftest import mixed_conversations
from tests.model.helpers import noise_image
from vlm_catalog import SamplingParams
from vlm_catalog.engine import warmup
from vlm_catalog.engine.config import EngineConfig
from vlm_catalog.engine.llm_engine import EngineStats, LLMEngine
from vlm_catalog.engine.warmup import warm_up, warmup_token_counts


@pytest.mark.parametrize("largest", [1, 15, 16, 100, 512, 1000, 16384])
def test_token_counts_reach_every_bucket_up_to_the_largest_step_aligned_and_not(largest):
    counts = warmup_token_counts(largest, max_prompt_tokens=10**6)
    assert counts == sorted(set(counts)) and max(counts) == largest and min(counts) == 1
    buckets = [b for b in TOKEN_BUCKETS if b <= largest] + ([token_bucket(largest)] if largest not in TOKEN_BUCKETS else [])
    assert {token_bucket(c) for c in counts} == set(buckets)
    for bucket in buckets:
        in_bucket = [c for c in counts if token_bucket(c) == bucket]
        if bucket >= 32 and largest >= bucket:  # room for both Triton specialisations of the token count
            assert any(c % 16 == 0 for c in in_bucket) and any(c % 16 for c in in_bucket), (bucket, in_bucket)


def test_token_counts_are_capped_by_the_prompt_room_and_go_past_the_table():
    assert max(warmup_token_counts(16384, max_prompt_tokens=3000)) == 3000
    beyond = warmup_token_counts(20000, max_prompt_tokens=10**6)
    assert beyond[-2:] == [19999, 20000]  # the last bucket's config at the step's own size
    assert 16384 in beyond


def test_warmup_is_on_by_default_on_cuda_only():
    assert EngineConfig(device="cuda").warms_up() and not EngineConfig(device="cpu").warms_up()
    for setting in (True, False):
        assert EngineConfig(device="cpu", warmup=setting).warms_up() == setting
        assert EngineConfig(device="cuda", warmup=setting).warms_up() == setting


def small_engine(checkpoint, **overrides) -> LLMEngine:
    return LLMEngine(model=checkpoint, max_num_batched_tokens=300, max_num_seqs=8, **overrides)


def run_to_the_end(engine: LLMEngine, requests: list[tuple[list[dict], SamplingParams]]) -> list[list[int]]:
    """The token ids of each request's answer, in request order."""
    for i, (conversation, params) in enumerate(requests):
        engine.add_request(conversation, params, request_id=f"r{i:03d}")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [finished[key] for key in sorted(finished)]


def test_a_warmed_up_engine_is_as_if_just_started_and_answers_the_same(engine_checkpoint):
    warmed = small_engine(engine_checkpoint, warmup=True)
    report = warmed.warmup_report
    assert report is not None and report.num_images_encoded == 1  # the image request ran
    assert report.token_counts == tuple(warmup_token_counts(300, 10**6))
    assert report.num_requests == len(report.token_counts) + 5 and report.num_steps > report.num_requests
    assert warmed.stats == EngineStats() and not warmed.requests and not warmed.has_unfinished_requests()
    assert warmed.block_manager.num_free_blocks == warmed.num_blocks and not warmed.block_manager.tables
    assert not warmed.block_manager.cached and set(warmed.block_manager.stats.values()) == {0}
    assert len(warmed.encoder_cache) == 0 and warmed.encoder_cache.hits == warmed.encoder_cache.misses == 0
    assert warmed.runner.num_images_encoded == 0 and warmed.runner.vision_timer.seconds == 0.0
    assert warmed.cache_stats()["warmup"]["num_requests"] == report.num_requests

    cold = small_engine(engine_checkpoint)
    assert cold.warmup_report is None and cold.cache_stats()["warmup"] is None
    conversations = mixed_conversations(6)
    requests = [(conversation, SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.9,
                                              seed=None if i % 2 else i))
                for i, conversation in enumerate(conversations)]
    requests.append((conversations[0], SamplingParams(max_tokens=8, temperature=1.0)))  # the engine's generator
    assert run_to_the_end(warmed, requests) == run_to_the_end(cold, requests)
    assert warmed.stats.num_prompt_tokens_computed == cold.stats.num_prompt_tokens_computed


def test_a_failing_warmup_request_stops_the_start_with_the_way_out(engine_checkpoint, monkeypatch):
    engine = small_engine(engine_checkpoint)
    real_encode = engine.runner.encode_images

    def images_fail(chunks):
        found, failures = real_encode(chunks)
        return {}, {**failures, **dict.fromkeys(found, "cannot decode the picture")}

    monkeypatch.setattr(engine.runner, "encode_images", images_fail)
    with pytest.raises(RuntimeError, match=r"warm-up request warmup-\d+ failed: cannot decode .*--warmup off"):
        warm_up(engine)


def test_the_warmup_sends_long_sequences_beside_short_ones_where_sdpa_would_take_the_long(engine_checkpoint,
                                                                                           monkeypatch):
    """FlashAttention 2's callers leave images of SDPA_MIN_SEGMENT_LEN patches and whole prompts
    of SDPA_MIN_PREFILL_LEN tokens to SDPA and the shorter ones of the same call to a Triton
    kernel (engine/warmup.py): the warm-up puts a large image beside the small one, and a long
    prompt beside a short one, each pair in one step. At the 30B thresholds the tiny model's
    processor never makes such an image (it caps both images at the same size), so the small image
    is made smaller and the thresholds lowered to the tiny model's sizes."""
    monkeypatch.setattr(warmup, "WARMUP_IMAGE_SIZE", (160, 120))
    engine = LLMEngine(model=engine_checkpoint, max_num_batched_tokens=1024, max_num_seqs=8, warmup=False)
    small, large = (engine.processor.process([{"role": "user", "content": [
        {"type": "image", "image": noise_image(*size, seed=1)}, {"type": "text", "text": "x"}]}])
        for size in (warmup.WARMUP_IMAGE_SIZE, warmup.WARMUP_LARGE_IMAGE_SIZE))
    patches = [warmup._patches(prompt) for prompt in (small, large)]
    assert patches[0] < patches[1]
    monkeypatch.setattr(warmup, "SDPA_MIN_SEGMENT_LEN", patches[1])
    monkeypatch.setattr(warmup, "SDPA_MIN_PREFILL_LEN", 200)
    images_per_call, prefills_per_step = [], []
    real_encode, real_execute = engine.runner.encode_images, engine.runner.execute

    def encode_images(chunks):
        found, failures = real_encode(chunks)
        images_per_call.append(len(found) + len(failures))
        return found, failures

    def execute(chunks, *args, **kwargs):  # (start, tokens) of the step's prefill chunks
        prefills_per_step.append([(c.start, c.num_tokens) for c in chunks if c.num_tokens > 1 or c.start == 0])
        return real_execute(chunks, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "encode_images", encode_images)
    monkeypatch.setattr(engine.runner, "execute", execute)
    report = warm_up(engine)
    assert report.num_images_encoded == 2 and max(images_per_call) == 2  # both images in one call
    assert report.num_requests == len(report.token_counts) + 8
    assert [(0, 200), (0, warmup.SHORT_PROMPT_TOKENS)] in prefills_per_step

    monkeypatch.setattr(warmup, "SDPA_MIN_SEGMENT_LEN", patches[1] + 1)  # the processor leaves it short: no large
    monkeypatch.setattr(warmup, "SDPA_MIN_PREFILL_LEN", 1024)  # no room beside it in a 1024-token step
    report = warm_up(engine)
    assert report.num_images_encoded == 1 and report.num_requests == len(report.token_counts) + 5


def test_warmup_refuses_an_engine_with_requests(engine_checkpoint):
    engine = small_engine(engine_checkpoint)
    engine.add_request(mixed_conversations(1)[0], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        warm_up(engine)


def test_the_warmup_option_of_the_front_doors():
    import argparse

    from vlm_catalog.engine.arguments import add_device_arguments, device_options

    parser = argparse.ArgumentParser()
    add_device_arguments(parser)
    assert device_options(parser.parse_args([]))["warmup"] is None
    assert device_options(parser.parse_args(["--warmup", "on"]))["warmup"] is True
    assert device_options(parser.parse_args(["--warmup", "off"]))["warmup"] is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--warmup", "yes"])


@pytest.mark.gpu
def test_gpu_engine_warms_up_by_default_and_answers_as_one_without(engine_checkpoint):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    settings = {"device": "cuda", "dtype": "float32", "max_num_batched_tokens": 96, "kv_cache_memory_bytes": 64 * 2**20}
    warmed, cold = LLMEngine(model=engine_checkpoint, **settings), LLMEngine(model=engine_checkpoint, warmup=False,
                                                                             **settings)
    assert warmed.warmup_report is not None and warmed.warmup_report.num_images_encoded == 1
    assert cold.warmup_report is None and warmed.stats == EngineStats()
    requests = [(conversation, SamplingParams(max_tokens=8, ignore_eos=True)) for conversation in mixed_conversations(4)]
    assert run_to_the_end(warmed, requests) == run_to_the_end(cold, requests)
