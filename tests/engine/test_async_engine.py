"""AsyncLLM: streaming, concurrency, aborts and per-request errors."""

import asyncio

import pytest

from tests.engine.conftest import conversation
from vlm_catalog import AsyncLLM, SamplingParams
from vlm_catalog.engine.llm_engine import EngineRequestError


@pytest.fixture(scope="module")
def engine(engine_checkpoint):
    engine = AsyncLLM(model=engine_checkpoint)
    yield engine
    engine.shutdown()


def test_streams_deltas_that_add_up(engine):
    async def run():
        deltas, last = [], None
        async for output in engine.generate(conversation(1, words=4), SamplingParams(max_tokens=10, ignore_eos=True)):
            deltas.append(output.delta_text)
            last = output
        return deltas, last

    deltas, last = asyncio.run(run())
    assert last.finished and last.finish_reason == "length" and len(last.token_ids) == 10
    assert "".join(deltas) == last.text and len(deltas) >= 2


def test_a_caller_that_stops_reading_holds_one_merged_output(engine):
    """Outputs not yet read are merged: a stream read only after the answer has finished gets
    one output, whose delta is the whole text. Before, a queue kept all 40 steps' outputs, each
    with every token so far (a slow streaming client grew the server by gigabytes)."""
    async def run():
        stream = engine.generate(conversation(2, words=4), SamplingParams(max_tokens=40, ignore_eos=True))
        first = await stream.__anext__()  # the request is running; now stop reading
        while engine.engine.has_unfinished_requests() or not engine._inbox.empty():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the engine thread has handed over the last output
        rest = [output async for output in stream]
        return first, rest

    first, rest = asyncio.run(run())
    assert len(rest) == 1 and rest[0].finished and len(rest[0].token_ids) == 40
    assert first.delta_text + rest[0].delta_text == rest[0].text


def test_fail_all_ends_every_request_in_flight_and_the_engine_serves_on(engine):
    """What `serve` does past its shutdown grace period: each stream raises the reason given."""
    from vlm_catalog.engine.async_engine import EngineUnavailableError

    async def endless(index):
        async for _ in engine.generate(conversation(index, words=3), SamplingParams(max_tokens=100_000, ignore_eos=True)):
            pass

    async def run():
        streams = [asyncio.ensure_future(endless(index)) for index in range(3)]
        while engine.engine.load_stats()["requests_running"] < 3:
            await asyncio.sleep(0.01)
        engine.fail_all("shutting down")
        return await asyncio.gather(*streams, return_exceptions=True)

    results = asyncio.run(run())
    assert all(isinstance(result, EngineUnavailableError) and str(result) == "shutting down" for result in results)
    assert engine.engine.load_stats()["kv_blocks_used"] == 0 and not engine._streams
    after = asyncio.run(_last_output(engine, conversation(4, words=3), SamplingParams(max_tokens=3, ignore_eos=True)))
    assert after.finish_reason == "length" and len(after.token_ids) == 3


async def _last_output(engine, prompt, params):
    last = None
    async for output in engine.generate(prompt, params):
        last = output
    return last


def test_concurrent_requests_and_an_error_in_between(engine):
    async def one(index):
        final = None
        async for output in engine.generate(conversation(index, images=index % 2, words=3), SamplingParams(max_tokens=6, ignore_eos=True)):
            final = output
        return final

    async def bad():
        async for _ in engine.generate([{"role": "user", "content": [{"type": "image", "image": b"junk"}]}]):
            pass

    async def run():
        results = await asyncio.gather(*(one(i) for i in range(8)), bad(), return_exceptions=True)
        return results

    results = asyncio.run(run())
    assert all(r.finish_reason == "length" and len(r.token_ids) == 6 for r in results[:8])
    assert isinstance(results[8], EngineRequestError)


def test_an_unexpected_error_adding_one_request_fails_only_that_request(engine, monkeypatch):
    """A bug that one request meets in `add_request` (here: its stop strings) is that request's
    EngineInternalError; the engine thread lives on, nothing of the request stays registered,
    and the next requests are answered."""
    import vlm_catalog.engine.llm_engine as llm_engine_module
    from vlm_catalog.engine.async_engine import EngineInternalError

    real_detokenizer = llm_engine_module.Detokenizer

    def detokenizer(tokenizer, stop, *args):
        if "boom" in stop:
            raise RuntimeError("a bug met by this request only")
        return real_detokenizer(tokenizer, stop, *args)

    monkeypatch.setattr(llm_engine_module, "Detokenizer", detokenizer)

    async def final(params, request_id):
        result = None
        async for output in engine.generate(conversation(1, words=3), params, request_id=request_id):
            result = output
        return result

    async def run():
        return await asyncio.gather(
            final(SamplingParams(max_tokens=4, stop=["boom"]), "bad"),
            final(SamplingParams(max_tokens=4, ignore_eos=True), "good"),
            return_exceptions=True,
        )

    bad, good = asyncio.run(run())
    assert isinstance(bad, EngineInternalError) and "a bug met by this request only" in str(bad)
    assert good.finish_reason == "length" and len(good.token_ids) == 4
    assert engine.is_running and "bad" not in engine.engine.requests and "bad" not in engine.engine.detokenizers
    after = asyncio.run(final(SamplingParams(max_tokens=3, ignore_eos=True), "after"))
    assert after.finish_reason == "length" and len(after.token_ids) == 3


def test_abort_and_disconnect_free_the_request(engine):
    async def run():
        stream = engine.generate(conversation(2, words=3), SamplingParams(max_tokens=500, ignore_eos=True), request_id="long")
        first = await stream.__anext__()
        await engine.abort("long")
        outputs = [first] + [output async for output in stream]
        # a caller that stops listening aborts its request too
        other = engine.generate(conversation(3, words=3), SamplingParams(max_tokens=500, ignore_eos=True), request_id="dropped")
        await other.__anext__()
        await other.aclose()
        for _ in range(100):
            if not engine.engine.requests:
                break
            await asyncio.sleep(0.05)
        return outputs

    outputs = asyncio.run(run())
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert len(outputs[-1].token_ids) < 500
    assert engine.engine.requests == {}
    assert engine.engine.block_manager.num_free_blocks == engine.engine.num_blocks


def test_async_scheduling_streams_the_same_answers_and_aborts_cleanly(engine, engine_checkpoint):
    """The service with `--async-scheduling`: the same streamed tokens, and an abort mid-stream
    frees everything (its sampled-but-unread token included)."""
    pipelined = AsyncLLM(model=engine_checkpoint, async_scheduling=True)
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, seed=5)

    async def stream(llm, index):
        return [output.token_ids async for output in llm.generate(conversation(index, words=4), params)]

    async def streams(llm):
        return await asyncio.wait_for(asyncio.gather(*(stream(llm, index) for index in range(4))), 60)

    async def aborted():
        stream = pipelined.generate(conversation(9, words=3), SamplingParams(max_tokens=500, ignore_eos=True),
                                    request_id="long")
        await stream.__anext__()
        await pipelined.abort("long")
        return [output async for output in stream]

    try:
        expected, got = asyncio.run(streams(engine)), asyncio.run(streams(pipelined))
        # the same answers; how many outputs a stream yields depends on timing (a reader that falls
        # behind gets the steps it missed merged into one), so each is compared as growing prefixes
        assert [outputs[-1] for outputs in got] == [outputs[-1] for outputs in expected]
        for outputs in got + expected:
            assert len(outputs[-1]) == 8
            assert all(later[:len(earlier)] == earlier and len(later) > len(earlier)
                       for earlier, later in zip(outputs, outputs[1:]))
        rest = asyncio.run(asyncio.wait_for(aborted(), 60))
        assert rest[-1].finish_reason == "abort" and -1 not in rest[-1].token_ids
        inner = pipelined.engine
        assert inner.block_manager.num_free_blocks == inner.num_blocks and not inner.requests
    finally:
        pipelined.shutdown()


def test_each_outputs_text_is_what_its_deltas_have_sent(engine):
    """With stop strings a delta holds back what may begin one; an output's `text` did not, so a
    caller reading `text` saw characters the final text then cut."""
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)
    unstopped = asyncio.run(_last_output(engine, conversation(5, words=3), params)).text
    assert len(unstopped) >= 24
    stop = unstopped[16:22]

    async def run():
        outputs = []
        async for output in engine.generate(conversation(5, words=3), SamplingParams(
                max_tokens=30, ignore_eos=True, temperature=0.0, stop=[stop])):
            outputs.append(output)
        return outputs

    outputs = asyncio.run(run())
    sent = ""
    for output in outputs:
        sent += output.delta_text
        assert output.text == sent, (output.text, sent)
    assert outputs[-1].finish_reason == "stop" and outputs[-1].text == unstopped[: unstopped.find(stop)]
