"""LLM.chat / extract feed the engine while it steps: prompts prepared in threads, a bounded queue."""

import threading

import pytest

from tests.engine.conftest import conversation
from vlm_catalog import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(engine_checkpoint):
    return LLM(engine_checkpoint, max_num_seqs=4, max_num_batched_tokens=256)


def run_all_at_once(engine, conversations, params):
    """The engine fed the old way: every request queued before the first step."""
    for index, messages in enumerate(conversations):
        engine.add_request(messages, params, request_id=f"direct-{index}")
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
    return [outputs[f"direct-{index}"].token_ids for index in range(len(conversations))]


def test_a_long_list_is_queued_a_bounded_number_ahead_and_prepared_off_the_engine_thread(llm, monkeypatch):
    engine = llm.engine
    ahead = max(64, engine.config.max_num_seqs)  # 64 here: max_num_seqs is 4
    conversations = [conversation(i, images=i % 2, words=2 + i % 4) for i in range(ahead + 16)]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    expected = run_all_at_once(engine, conversations, params)

    waiting_at_add, preparing_threads, steps_before_last_add = [], set(), []
    steps = 0
    real_add, real_step, real_process = engine.add_request, engine.step, engine.processor.process

    def add_request(*args, **kwargs):
        waiting_at_add.append(engine.num_waiting_requests)
        steps_before_last_add.append(steps)
        return real_add(*args, **kwargs)

    def step():
        nonlocal steps
        steps += 1
        return real_step()

    def process(messages):
        preparing_threads.add(threading.current_thread().name)
        return real_process(messages)

    monkeypatch.setattr(engine, "add_request", add_request)
    monkeypatch.setattr(engine, "step", step)
    monkeypatch.setattr(engine.processor, "process", process)
    outputs = llm.chat(conversations, params)

    assert [output.token_ids for output in outputs] == expected  # the same answers, in input order
    assert len(waiting_at_add) == len(conversations) and max(waiting_at_add) < ahead
    assert steps_before_last_add[-1] > 0  # the engine stepped before the last prompt was queued
    assert preparing_threads and all(name.startswith("read-ahead-prepare") for name in preparing_threads)


def test_bad_prompts_past_the_first_window_fail_in_place(llm):
    conversations = [conversation(i, words=2) for i in range(70)]
    conversations[66] = [{"role": "user", "content": [{"type": "image", "image": b"not an image"}]}]
    params = [SamplingParams(max_tokens=2, ignore_eos=True)] * 70
    params[3] = SamplingParams(max_tokens=2, json_schema={"type": "nonsense"})  # refused by add_request
    outputs = llm.chat(conversations, params)
    assert [i for i, o in enumerate(outputs) if o.finish_reason == "error"] == [3, 66]
    assert "schema" in outputs[3].error.lower() and "image" in outputs[66].error
    assert all(len(o.token_ids) == 2 for i, o in enumerate(outputs) if i not in (3, 66))


def test_an_interrupted_run_leaves_nothing_running(llm, monkeypatch):
    engine = llm.engine
    real_step, calls = engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.chat([conversation(i, words=3) for i in range(20)], SamplingParams(max_tokens=8, ignore_eos=True))
    monkeypatch.setattr(engine, "step", real_step)
    engine.step()  # the aborted requests' last outputs
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    assert len(llm.chat([conversation(1, words=3)], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2


def failing_step(monkeypatch, engine, fails):
    """`engine.step` raising where `fails(call number, request ids scheduled)` says."""
    real_run_step, calls = engine._run_step, []

    def run_step(output, pending):
        calls.append(1)
        if fails(len(calls), {chunk.request.request_id for chunk in output.chunks}):
            raise RuntimeError("CUDA error: out of memory")
        return real_run_step(output, pending)

    monkeypatch.setattr(engine, "_run_step", run_step)


def test_a_failed_step_costs_no_answer_and_a_request_that_fails_alone_is_its_error(llm, monkeypatch):
    """Before, one failed step raised out of `chat`, losing the answers already made; a request that
    failed every step made every call raise."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    conversations = [conversation(i, words=3) for i in range(10)]
    expected = [output.token_ids for output in llm.chat(conversations, params)]
    failing_step(monkeypatch, llm.engine, lambda call, scheduled: call == 2)
    assert [output.token_ids for output in llm.chat(conversations, params)] == expected

    first = next(llm._request_counter) + 1  # the ids the next call gives its requests
    poison = f"llm-{first + 6}"
    failing_step(monkeypatch, llm.engine, lambda call, scheduled: poison in scheduled)
    outputs = llm.chat(conversations, params)
    assert [i for i, output in enumerate(outputs) if output.finish_reason == "error"] == [6]
    assert outputs[6].error == "internal engine error: RuntimeError: CUDA error: out of memory"
    assert [output.token_ids for i, output in enumerate(outputs) if i != 6] == expected[:6] + expected[7:]
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_an_engine_that_fails_every_step_raises_engine_failing(llm, monkeypatch):
    from vlm_catalog.engine.step_faults import EngineFailing

    failing_step(monkeypatch, llm.engine, lambda call, scheduled: True)
    with pytest.raises(EngineFailing, match="16 engine steps in a row failed"):
        llm.chat([conversation(i, words=3) for i in range(3)], SamplingParams(max_tokens=2, ignore_eos=True))
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.chat([conversation(1, words=3)], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2
