"""Async scheduling (`EngineConfig.async_scheduling`): step N+1 is scheduled and launched before
step N's sampled tokens are read. Greedy and seeded answers must be the engine's usual ones,
whatever ends a request (length, EOS, stop token or string, grammar, abort), with chunked
prefill, jump-forward and preemption; no placeholder may ever reach an output."""

import random
import time
from types import SimpleNamespace

import pytest
import torch

from tests.engine.conftest import conversation, mixed_conversations, run_waves_with_aborts
from tests.engine.test_engine_behaviour import catalogue_requests
from tests.engine.test_llm_feeding import failing_step
from vlm_catalog import LLM, SamplingParams
from vlm_catalog.engine.pending_tokens import PendingTokens
from vlm_catalog.engine.request import PLACEHOLDER_TOKEN, Request


def answers(outputs) -> list[tuple]:
    return [(o.token_ids, o.text, o.finish_reason, o.error) for o in outputs]


def varied_params(count: int) -> list[SamplingParams]:
    """Greedy and seeded requests of different lengths; some may stop at EOS."""
    params = []
    for index in range(count):
        sampled = {"temperature": 0.9, "top_p": 0.9, "seed": index} if index % 2 else {}
        params.append(SamplingParams(max_tokens=4 + 5 * (index % 4), ignore_eos=index % 3 == 0, **sampled))
    return params


@pytest.fixture(scope="module")
def sync_and_async(engine_checkpoint):
    settings = {"max_num_batched_tokens": 96}  # chunked prefill: prompts spread over steps
    return (LLM(engine_checkpoint, async_scheduling=False, **settings),
            LLM(engine_checkpoint, async_scheduling=True, **settings))


def test_async_scheduling_is_on_by_default_on_cuda_only_and_a_setting_overrides_it():
    from vlm_catalog.engine.config import EngineConfig

    assert EngineConfig(device="cuda").schedules_async() and not EngineConfig(device="cpu").schedules_async()
    for setting in (True, False):
        assert EngineConfig(device="cpu", async_scheduling=setting).schedules_async() == setting
        assert EngineConfig(device="cuda", async_scheduling=setting).schedules_async() == setting


def test_the_async_scheduling_option_of_the_front_doors():
    import argparse

    from vlm_catalog.engine.arguments import add_device_arguments, device_options

    parser = argparse.ArgumentParser()
    add_device_arguments(parser)
    settings = [device_options(parser.parse_args(args))["async_scheduling"]
                for args in ([], ["--async-scheduling"], ["--async-scheduling", "on"],
                             ["--async-scheduling", "off"], ["--async-scheduling", "auto"])]
    assert settings == [None, True, True, False, None]
    with pytest.raises(SystemExit):
        parser.parse_args(["--async-scheduling", "yes"])


def test_the_engine_resolves_auto_where_it_runs(sync_and_async, engine_checkpoint):
    sync, pipelined = sync_and_async
    assert sync.engine.async_scheduling is False and pipelined.engine.async_scheduling is True
    auto = LLM(engine_checkpoint, max_num_batched_tokens=96)
    assert auto.engine.config.async_scheduling is None and auto.engine.async_scheduling is False  # CPU


def test_the_same_answers_as_reading_each_step_first(sync_and_async):
    sync, pipelined = sync_and_async
    prompts = mixed_conversations(12)
    params = varied_params(12)
    assert answers(pipelined.chat(prompts, params)) == answers(sync.chat(prompts, params))
    engine = pipelined.engine
    assert not engine.has_unfinished_requests() and engine._pending is None
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_stop_tokens_stop_strings_and_logprobs(sync_and_async):
    sync, pipelined = sync_and_async
    messages = [conversation(2, words=5)]
    free = sync.chat(messages, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    stop_text = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    requests = [
        SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[free.token_ids[5]]),
        SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop_text] if stop_text.strip() else None),
        SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3),  # read at once: logprobs need the host
    ]
    for params in requests:
        expected, got = sync.chat(messages, params)[0], pipelined.chat(messages, params)[0]
        assert answers([got]) == answers([expected])
        assert got.logprobs == expected.logprobs


def test_constrained_answers_with_jump_forward(sync_and_async):
    sync, pipelined = sync_and_async
    prompts, params = catalogue_requests(16, seed=3, brand_max=10, temperature=lambda index: 0.8 if index % 3 == 0 else 0.0)
    expected = sync.chat(prompts, params)
    assert answers(pipelined.chat(prompts, params)) == answers(expected)
    assert pipelined.engine.stats.num_jump_forward_tokens > 0


def test_preemption_and_a_small_pool(engine_checkpoint):
    settings = {"block_size": 4, "kv_cache_memory_bytes": 160 * 2048, "max_num_seqs": 16}
    sync = LLM(engine_checkpoint, async_scheduling=False, **settings)
    pipelined = LLM(engine_checkpoint, async_scheduling=True, **settings)
    prompts = [conversation(index, words=6 + index % 5) for index in range(16)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, **({"temperature": 1.0, "seed": i} if i % 2 else {}))
              for i in range(16)]
    assert answers(pipelined.chat(prompts, params)) == answers(sync.chat(prompts, params))
    assert pipelined.engine.stats.num_preemptions > 0
    assert pipelined.engine.block_manager.num_free_blocks == pipelined.engine.num_blocks


def test_outputs_come_one_step_later_and_never_hold_a_placeholder(sync_and_async):
    sync, pipelined = sync_and_async
    messages = conversation(5, images=1, words=4)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    engine = pipelined.engine
    steps_before = engine.stats.num_steps
    request_id = engine.add_request(messages, params)
    streamed, steps = [], 0
    while engine.has_unfinished_requests():
        outputs = [o for o in engine.step() if o.request_id == request_id]
        steps += 1
        if engine._pending is not None and engine._pending.requests:
            request = engine._pending.requests[0]
            assert request.has_placeholder and request.token_ids[-1] == PLACEHOLDER_TOKEN
        streamed.extend(outputs)
    assert len(streamed) == 10  # one per token, as without async scheduling
    assert all(PLACEHOLDER_TOKEN not in o.token_ids for o in streamed)
    assert [len(o.token_ids) for o in streamed] == list(range(1, 11))
    assert streamed[-1].token_ids == sync.chat([messages], params)[0].token_ids
    # the last call only read the last step's tokens: a request whose last token is sampled is not
    # scheduled again, so no step computes a token nobody will use
    assert steps == engine.stats.num_steps - steps_before + 1


def test_aborts_leave_nothing_behind(engine_checkpoint):
    llm = LLM(engine_checkpoint, block_size=4, kv_cache_memory_bytes=512 * 2048, max_num_seqs=32,
              async_scheduling=True)
    engine = llm.engine

    def check(output) -> None:
        assert PLACEHOLDER_TOKEN not in output.token_ids

    assert run_waves_with_aborts(engine, waves=6, per_wave=60, rng=random.Random(0), check_output=check) == 360
    assert engine.requests == {} and engine.detokenizers == {} and engine._pending is None
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    assert engine.scheduler.num_unfinished == 0


def test_request_placeholder_bookkeeping(sync_and_async):
    prompt = sync_and_async[0].engine.processor.process([{"role": "user", "content": "a b c d e f"}])
    request = Request("r", prompt, SamplingParams(max_tokens=8), max_model_len=512)
    block_size = prompt.num_tokens + 1  # the placeholder would complete the first block
    request.append_placeholder()
    assert request.output_token_ids == [] and request.num_tokens == prompt.num_tokens + 1
    assert request.block_hashes(block_size) == []  # the block's last token is not known yet
    with pytest.raises(RuntimeError, match="already waits"):
        request.append_placeholder()
    request.resolve_placeholder(42)
    assert request.output_token_ids == [42] and len(request.block_hashes(block_size)) == 1
    with pytest.raises(RuntimeError, match="no sampled token pending"):
        request.resolve_placeholder(7)
    request.append_placeholder()
    request.resolve_placeholder(None)  # the request ended meanwhile: the place goes
    assert request.output_token_ids == [42] and not request.has_placeholder


def test_pending_tokens_check_their_shape_and_are_read_once_ready():
    with pytest.raises(ValueError, match="2 requests"):
        PendingTokens([object(), object()], torch.tensor([1, 2, 3]))
    pending = PendingTokens([SimpleNamespace(request_id="a"), SimpleNamespace(request_id="b")], torch.tensor([7, 9]))
    assert pending.rows == {"a": 0, "b": 1} and not pending.was_read
    assert pending.read() == [7, 9] and pending.was_read
    assert pending.wait_seconds == 0.0  # CPU tokens: nothing to wait for


class SlowEvent:
    """A CUDA event the device reaches `delay` seconds after the host asks (a stand-in)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def synchronize(self) -> None:
        time.sleep(self.delay)


def test_the_hosts_wait_for_sampled_tokens_is_counted_for_the_steps_kind(engine_checkpoint, monkeypatch):
    """Each read of the previous step's tokens waits on its event; the engine adds each wait to
    the kind of step that read them (prefill or decode), and its own time outside the steps to
    scheduling and to building outputs (EngineStats)."""
    import vlm_catalog.engine.llm_engine as llm_engine

    class SlowPendingTokens(PendingTokens):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._ready = SlowEvent(0.01)

    monkeypatch.setattr(llm_engine, "PendingTokens", SlowPendingTokens)
    llm = LLM(engine_checkpoint, async_scheduling=True)
    stats = llm.engine.stats
    llm.chat([conversation(5, images=0)], SamplingParams(max_tokens=5, ignore_eos=True))
    # one prefill step, then four decode steps, each reading the step before's token
    assert (stats.num_prefill_steps, stats.num_decode_steps) == (1, 4)
    assert stats.seconds_waiting_for_sampled_tokens_prefill_steps == 0.0  # the first step reads nothing
    assert 0.04 <= stats.seconds_waiting_for_sampled_tokens_decode_steps <= stats.seconds_in_decode_steps
    assert stats.seconds_scheduling > 0.0 and stats.seconds_building_outputs > 0.0
    llm.engine.close()


def test_a_step_that_fails_before_reading_the_tokens_leaves_them_for_the_next(sync_and_async, monkeypatch):
    sync, pipelined = sync_and_async
    engine = pipelined.engine
    prompts = mixed_conversations(4)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ids = [engine.add_request(messages, params) for messages in prompts]
    for _ in range(3):
        engine.step()
    assert engine._pending is not None
    real_execute = engine.runner.execute

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(engine.runner, "execute", real_execute)
        raise RuntimeError("device hiccup")

    monkeypatch.setattr(engine.runner, "execute", fail_once)
    with pytest.raises(RuntimeError, match="device hiccup"):
        engine.step()
    assert engine._pending is not None and not engine._pending.was_read
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    assert [finals[i] for i in ids] == [o.token_ids for o in sync.chat(prompts, params)]


@pytest.mark.gpu
def test_on_cuda_with_graphs_the_same_answers(engine_checkpoint):
    """On a GPU: decode inputs gathered on the device feed the CUDA graphs, the tokens cross in
    pinned memory behind an event, and the answers are the synchronous engine's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    settings = {"device": "cuda", "dtype": "float32", "max_num_batched_tokens": 96, "kv_cache_memory_bytes": 64 * 2**20}
    sync = LLM(engine_checkpoint, async_scheduling=False, **settings)  # off: the default on CUDA is on
    pipelined = LLM(engine_checkpoint, async_scheduling=True, **settings)
    assert pipelined.engine.runner.graph_runner is not None and not sync.engine.async_scheduling
    prompts = mixed_conversations(12)
    params = varied_params(12)
    assert answers(pipelined.chat(prompts, params)) == answers(sync.chat(prompts, params))


@pytest.mark.gpu
def test_on_cuda_a_step_that_fails_costs_no_answer_and_a_request_that_fails_alone_is_its_error(
        engine_checkpoint, monkeypatch):
    """On a GPU, with CUDA graphs and async scheduling (the defaults there): a failed step's requests
    are dropped (`abort_all`: blocks, graph rows, tokens still on the device) and run again by
    bisection under the same ids; the answers are a clean run's, and a request that fails every step
    it is in is the only error."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    settings = {"device": "cuda", "dtype": "float32", "max_num_batched_tokens": 96, "kv_cache_memory_bytes": 64 * 2**20}
    llm = LLM(engine_checkpoint, **settings)
    engine = llm.engine
    assert engine.async_scheduling and engine.runner.graph_runner is not None
    prompts = mixed_conversations(12)
    params = varied_params(12)
    expected = answers(llm.chat(prompts, params))
    failing_step(monkeypatch, engine, lambda call, scheduled: call == 6)  # mid-decode, tokens pending on the device
    assert answers(llm.chat(prompts, params)) == expected
    monkeypatch.undo()
    first = next(llm._request_counter) + 1
    poison = f"llm-{first + 5}"
    failing_step(monkeypatch, engine, lambda call, scheduled: poison in scheduled)
    outputs = llm.chat(prompts, params)
    assert [i for i, output in enumerate(outputs) if output.finish_reason == "error"] == [5]
    assert [answer for i, answer in enumerate(answers(outputs)) if i != 5] == expected[:5] + expected[6:]
    assert engine.block_manager.num_free_blocks == engine.num_blocks and engine._pending is None


@pytest.mark.gpu
def test_pending_tokens_from_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.cuda._sleep(200_000_000)  # about 0.1 s of device time queued before the tokens' copy
    tokens = torch.arange(5, device="cuda") * 3
    pending = PendingTokens([SimpleNamespace(request_id=f"r{i}") for i in range(5)], tokens)
    assert pending.rows["r3"] == 3 and not pending.was_read
    assert pending.read() == [0, 3, 6, 9, 12] and pending.was_read
    assert pending.wait_seconds > 0.01  # the host waited for the device to get there


def test_a_failed_read_of_the_sampled_tokens_fails_one_step_not_every_one(sync_and_async, monkeypatch):
    """Reading a step's sampled tokens is where a device fault shows under async scheduling. The
    tokens stayed pending after the failed step's requests were dropped, so every later step read
    them again and failed: each request run alone was blamed, and a server's engine thread spun."""
    sync, pipelined = sync_and_async
    prompts = mixed_conversations(6)
    params = varied_params(6)
    expected = answers(sync.chat(prompts, params))
    real_read, reads = PendingTokens.read, []

    def read(self):
        reads.append(1)
        if len(reads) == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_read(self)

    monkeypatch.setattr(PendingTokens, "read", read)
    assert answers(pipelined.chat(prompts, params)) == expected  # the step's requests ran again
    engine = pipelined.engine
    assert not engine.has_unfinished_requests() and engine._pending is None
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_a_server_engine_whose_token_reads_keep_failing_goes_idle_not_round_and_round():
    """Every read failing (a dead device): the service's engine thread failed the request, then found
    the same unread tokens pending and stepped again, failing and logging, in a loop that never ended."""
    import asyncio

    from vlm_catalog.engine.async_engine import AsyncLLM, EngineInternalError
    from vlm_catalog.paths import DEFAULT_MODEL_DIR

    engine = AsyncLLM(model=DEFAULT_MODEL_DIR, async_scheduling=True, max_num_seqs=4)
    real_step, steps = engine.engine.step, []

    def counted_step():
        steps.append(1)
        return real_step()

    def dead(self):
        raise RuntimeError("CUDA error: unspecified launch failure")

    async def run():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(PendingTokens, "read", dead)
            engine.engine.step = counted_step
            with pytest.raises(EngineInternalError):
                async for _ in engine.generate([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=4)):
                    pass
            await asyncio.sleep(0.3)
            settled = len(steps)
            await asyncio.sleep(0.5)
            return settled, len(steps)

    try:
        settled, later = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        engine.shutdown()
    assert later == settled  # idle: no step since the failure
