"""The engine under the service: duplicate ids, lone surrogates, unknown roles, a dying engine thread."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from tests.server.conftest import png_bytes
from vlm_catalog import LLM, SamplingParams
from vlm_catalog.engine.async_engine import AsyncLLM, EngineUnavailableError
from vlm_catalog.engine.llm_engine import EngineRequestError
from vlm_catalog.paths import DEFAULT_MODEL_DIR
from vlm_catalog.preprocess.processor import PromptError

LONG = SamplingParams(max_tokens=60, regex="[ab]{60}")


def user(text: str, role: str = "user") -> list[dict]:
    return [{"role": role, "content": text}]


def test_a_duplicate_request_id_is_refused_at_once_and_the_first_still_finishes(engine):
    async def run():
        first = engine.generate(user("first"), LONG, request_id="same-id")
        opening = await first.__anext__()
        started = time.perf_counter()
        with pytest.raises(EngineRequestError, match="already in flight"):
            async for _ in engine.generate(user("second"), LONG, request_id="same-id"):
                pass
        refused_after = time.perf_counter() - started
        outputs = [opening] + [output async for output in first]
        # once the first has finished, the id may be used again
        again = [output async for output in engine.generate(user("third"), SamplingParams(max_tokens=2), "same-id")]
        return refused_after, outputs[-1], again[-1]

    refused_after, final, again = asyncio.run(asyncio.wait_for(run(), 60))
    assert refused_after < 0.5
    assert final.finished and final.finish_reason == "stop" and len(final.token_ids) >= 1
    assert final.text and set(final.text) <= {"a", "b"} and len(final.text) == 60
    assert again.finished


def test_unknown_role_and_lone_surrogate_fail_their_request_only(engine):
    async def run(messages):
        return [output async for output in engine.generate(messages, SamplingParams(max_tokens=3))]

    with pytest.raises(EngineRequestError, match="unknown role 'hacker'"):
        asyncio.run(run(user("hello", role="hacker")))
    with pytest.raises(EngineRequestError, match="unpaired surrogate"):
        asyncio.run(run(user("bad \ud800 text")))
    with pytest.raises(EngineRequestError, match="part 1: text contains an unpaired surrogate"):
        asyncio.run(run([{"role": "user", "content": [{"type": "text", "text": "ok"},
                                                      {"type": "text", "text": "\udfff"}]}]))
    assert asyncio.run(run(user("hello")))[-1].finished


def test_processor_refuses_with_prompt_error(engine):
    processor = engine.engine.processor
    with pytest.raises(PromptError, match="unknown role 'hacker'; use one of system, user, assistant"):
        processor.process(user("x", role="hacker"))
    with pytest.raises(PromptError, match="message 1: text contains an unpaired surrogate"):
        processor.process([{"role": "system", "content": "fine"}, {"role": "user", "content": "\ud83d alone"}])
    # a properly paired character outside the BMP is fine
    assert processor.process(user("emoji \U0001f600 ok")).num_tokens > 0


def test_llm_chat_batch_survives_a_lone_surrogate_an_unknown_role_and_a_truncated_png():
    truncated = [{"role": "user", "content": [{"type": "image", "image": png_bytes(90, 70)[:-30]}]}]
    llm = LLM(DEFAULT_MODEL_DIR)
    try:
        outputs = llm.chat(
            [user("first"), user("broken \ud800"), user("third", role="hacker"), truncated, user("fifth")],
            SamplingParams(max_tokens=4),
        )
    finally:
        llm.engine.close()
    assert [output.finish_reason for output in outputs] == ["length", "error", "error", "error", "length"]
    assert "unpaired surrogate" in outputs[1].error and "unknown role" in outputs[2].error
    assert "truncated or corrupt" in outputs[3].error
    assert len(outputs[0].token_ids) == 4 and len(outputs[4].token_ids) == 4


def test_a_dying_engine_thread_fails_waiting_requests_and_refuses_new_ones():
    engine = AsyncLLM(model=DEFAULT_MODEL_DIR, max_num_seqs=4)

    def die():
        raise SystemExit("simulated death of the engine thread")

    async def run():
        stream = engine.generate(user("hello"), LONG)
        await stream.__anext__()
        engine.engine.step = die  # the next step kills the thread (SystemExit is not caught as a step bug)
        with pytest.raises(EngineUnavailableError):
            async for _ in stream:
                pass
        assert not engine.is_running
        with pytest.raises(EngineUnavailableError):
            async for _ in engine.generate(user("after"), SamplingParams(max_tokens=2)):
                pass
        stats = engine.load_stats()  # before, the gauges froze at the load the thread died with
        assert stats["requests_running"] == stats["requests_waiting"] == stats["kv_cache_usage_ratio"] == 0

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        engine.shutdown()


def test_health_turns_503_while_steps_keep_failing_or_one_hangs_and_back_once_the_device_works():
    """`/health` said 200 while every step raised (a dead device) or one hung: only the engine thread
    was checked, so a load balancer kept the instance in rotation."""
    import threading

    import httpx

    from vlm_catalog.server.app import create_app
    from vlm_catalog.server.settings import ServerSettings

    engine = AsyncLLM(model=DEFAULT_MODEL_DIR, max_num_seqs=4)
    app = create_app(engine, ServerSettings(health_step_timeout_s=0.5))
    real_step = engine.engine.step
    release = threading.Event()

    real_run_step = engine.engine._run_step

    def dead(output, pending):  # a step with nothing to run (a grammar still compiling) shows nothing
        if output.chunks:
            raise RuntimeError("CUDA error: unspecified launch failure")
        return real_run_step(output, pending)

    def hung():
        release.wait(10)
        return real_step()

    async def health():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            response = await client.get("/health")
            return response.status_code, response.json()["status"]

    async def failing_request(index):  # constrained, as /v1/extract's: its first steps wait for the grammar
        params = SamplingParams(max_tokens=2, json_schema={"type": "object", "properties": {f"k{index}": {"type": "integer"}}})
        with pytest.raises(Exception, match="internal engine error"):
            async for _ in engine.generate(user("hello"), params):
                pass

    async def run():
        assert await health() == (200, "ok")
        engine.engine._run_step = dead
        for index in range(3):  # before, the empty steps between them reset the count: 200 for ever
            await failing_request(index)
        code, status = await health()  # each request failed, ran alone and failed, probes failed, then its probe
        assert code == 503 and re.fullmatch(r"the last (\d+) engine steps failed", status), status
        engine.engine._run_step = real_run_step  # the device is back: the probe's step works
        assert await health() == (200, "ok")
        engine.engine.step = hung
        stream = engine.generate(user("hello"), SamplingParams(max_tokens=2))
        waiting = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(1.0)
        code, status = await health()
        assert code == 503 and status.startswith("an engine step has run for "), status
        release.set()
        await waiting
        engine.engine.step = real_step
        assert await health() == (200, "ok")

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        engine.shutdown()


def test_a_request_that_fails_its_engine_steps_is_the_only_500(app, engine, monkeypatch):
    """Before, a failed step failed every request in flight: one record meeting a bug answered 500
    to every concurrent client. Now the step's requests run again (`AsyncLLM`) and only that one fails."""
    from tests.server.conftest import call_many, chat_body

    bodies = [chat_body(f"Describe product {i}.", max_tokens=6, temperature=0) for i in range(4)]
    expected = [response.json()["choices"][0]["message"]["content"]
                for response in call_many(app, [("POST", "/v1/chat/completions", {"json": body}) for body in bodies])]
    real_run_step = engine.engine._run_step

    def run_step(output, pending):  # the request asking for 6 tokens with a top_p of 0.5 meets a bug
        if any(chunk.request.params.top_p == 0.5 for chunk in output.chunks):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_run_step(output, pending)

    monkeypatch.setattr(engine.engine, "_run_step", run_step)
    bodies[2]["top_p"] = 0.5
    responses = call_many(app, [("POST", "/v1/chat/completions", {"json": body}) for body in bodies])
    assert [response.status_code for response in responses] == [200, 200, 500, 200]
    assert responses[2].json()["error"]["code"] == "internal_error"
    assert "CUDA error: an illegal memory access" in responses[2].json()["error"]["message"]
    assert [responses[i].json()["choices"][0]["message"]["content"] for i in (0, 1, 3)] == [expected[i] for i in (0, 1, 3)]
