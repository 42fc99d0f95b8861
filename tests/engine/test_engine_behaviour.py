"""Engine behaviour: batch invariance, constrained decoding, jump-forward, errors, stops, leaks."""

import random
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
from PIL import Image

from schemas import ProductMetadata
from tests.engine.conftest import conversation, mixed_conversations, run_waves_with_aborts
from tests.model.helpers import noise_image
from vlm_catalog import LLM, SamplingParams
from vlm_catalog.engine.config import EngineConfig
from vlm_catalog.engine.llm_engine import LLMEngine
from vlm_catalog.engine.sampling_params import SamplingParamsError
from vlm_catalog.structured import catalogue_schema


@pytest.fixture(scope="module")
def llm(engine_checkpoint):
    return LLM(engine_checkpoint, max_num_batched_tokens=512)


def test_batch_invariance_greedy_and_seeded(llm):
    target = conversation(3, images=1, words=6)
    others = [conversation(10 + i, images=i % 2, words=3 + i % 5) for i in range(31)]
    for params in (SamplingParams(max_tokens=16, ignore_eos=True),
                   SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, top_p=0.95, seed=1234)):
        alone = llm.chat([target], params)[0].token_ids
        batch = llm.chat(others[:17] + [target] + others[17:], params)
        assert batch[17].token_ids == alone


def test_seeded_sampling_is_reproducible_and_seeds_differ(llm):
    messages = [conversation(1, words=4)]
    runs = [llm.chat(messages, SamplingParams(max_tokens=20, temperature=1.0, seed=s, ignore_eos=True))[0].token_ids
            for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def product_prompt(index: int, rng: random.Random) -> tuple[list[dict], list[str]]:
    roots = ["Home & Garden > Kitchen", "Apparel > Shoes", "Toys > Puzzles"]
    candidates = [f"{rng.choice(roots)} > Leaf {rng.randrange(20)}" for _ in range(rng.choice([8, 9]))]
    candidates = list(dict.fromkeys(candidates))
    text = f"Product {index}. Candidates: {candidates}. Answer in JSON."
    return [{"role": "user", "content": text}], candidates


def catalogue_requests(count: int, seed: int, brand_max: int, temperature, max_tokens: int = 100):
    """`count` product prompts with their per-record schemas (the brand at most `brand_max`
    characters, so a random model's answers finish), sampled at `temperature(index)`, seeded
    by index: (prompts, params)."""
    rng = random.Random(seed)
    prompts, params = [], []
    for index in range(count):
        messages, candidates = product_prompt(index, rng)
        schema = catalogue_schema(candidates).json_schema
        schema["properties"]["brand"]["maxLength"] = brand_max
        prompts.append(messages)
        params.append(SamplingParams(max_tokens=max_tokens, temperature=temperature(index), seed=index,
                                     json_schema=schema))
    return prompts, params


def test_every_constrained_answer_parses_over_hundreds_of_generations(llm):
    rng = random.Random(0)
    prompts, params, candidate_lists = [], [], []
    for index in range(200):
        messages, candidates = product_prompt(index, rng)
        schema = catalogue_schema(candidates).json_schema
        # a random model rarely closes a free-text string; bounding the brand lets answers finish
        schema["properties"]["brand"]["maxLength"] = 8
        prompts.append(messages)
        candidate_lists.append(candidates)
        params.append(SamplingParams(max_tokens=120, temperature=1.0 if index % 2 else 0.0, seed=index, json_schema=schema))
    before = dict(llm.engine.stats.as_dict())
    outputs = llm.chat(prompts, params)
    finished = [o for o in outputs if o.finish_reason != "length"]
    assert len(finished) >= 190
    stats = llm.engine.stats.as_dict()  # the grammars' host time is counted, within the steps' own
    fill, advance, masking = (stats[key] - before[key] for key in (
        "seconds_filling_grammar_masks", "seconds_advancing_grammars", "seconds_masking_logits"))
    steps = sum(stats[key] - before[key] for key in ("seconds_in_prefill_steps", "seconds_in_decode_steps"))
    assert 0 < fill and 0 < advance and 0 < masking and fill + advance + masking < steps
    assert stats["num_grammars_attached"] - before["num_grammars_attached"] == 200  # each waited for its grammar
    assert stats["seconds_awaiting_grammars"] > before["seconds_awaiting_grammars"]
    for output, candidates in zip(outputs, candidate_lists):
        if output.finish_reason == "length":
            continue
        assert output.finish_reason == "stop", output.error
        answer = ProductMetadata.model_validate_json(output.text)
        assert answer.category in candidates


def test_a_head_wider_than_the_tokenizer_never_samples_its_padding_under_a_grammar(tmp_path):
    """970 tokens under a 1,024-wide head: the grammars' bitmasks cover 992 ids (the tokenizer's to a
    whole word, `GrammarVocabulary.mask_size`) and the engine disallows the 32 columns past them;
    sampled at temperature 1 from a random model, every answer parses and no token is padding."""
    from tests.model.helpers import build_checkpoint
    from vlm_catalog.model.tiny_checkpoint import build_tokenizer

    tokenizer = build_tokenizer(970)
    padded = LLM(build_checkpoint(tmp_path / "padded", tokenizer, seed=11))
    assert padded.engine.grammar_service.vocabulary.mask_size == 992 < padded.engine.model_config.text.vocab_size
    prompts, params = catalogue_requests(16, seed=5, brand_max=8, temperature=lambda index: 1.0)
    outputs = padded.chat(prompts, params)
    assert all(token < len(tokenizer) for output in outputs for token in output.token_ids)
    for output in outputs:
        if output.finish_reason == "stop":
            ProductMetadata.model_validate_json(output.text)
    assert sum(output.finish_reason == "stop" for output in outputs) >= 12


def test_jump_forward_on_and_off_give_the_same_text_with_fewer_steps(engine_checkpoint):
    # brand-sized answers, as real products have
    prompts, params = catalogue_requests(24, seed=1, brand_max=12, temperature=lambda index: 0.8 if index % 3 == 0 else 0.0,
                                         max_tokens=120)
    on, off = LLM(engine_checkpoint), LLM(engine_checkpoint, enable_jump_forward=False)
    outputs_on, outputs_off = on.chat(prompts, params), off.chat(prompts, params)
    assert [o.text for o in outputs_on] == [o.text for o in outputs_off]
    assert [o.token_ids for o in outputs_on] == [o.token_ids for o in outputs_off]
    steps_on = sum(o.metrics["num_model_steps"] for o in outputs_on)
    steps_off = sum(o.metrics["num_model_steps"] for o in outputs_off)
    assert steps_on <= 0.7 * steps_off
    assert on.engine.stats.num_jump_forward_tokens == steps_off - steps_on


def test_jump_forward_auto_is_on_for_eager_decoding_and_off_where_decode_replays_cuda_graphs():
    config = EngineConfig()
    assert config.enable_jump_forward is None  # auto
    assert config.jump_forward(decode_graphs=False) and not config.jump_forward(decode_graphs=True)
    for setting in (True, False):  # an explicit setting wins either way
        config = EngineConfig(enable_jump_forward=setting)
        assert config.jump_forward(decode_graphs=False) == config.jump_forward(decode_graphs=True) == setting


def test_an_engine_with_decode_graphs_leaves_jump_forward_off_and_answers_the_same(engine_checkpoint, monkeypatch):
    """With captured decode graphs, forced tokens would make every step multi-token and eager;
    auto then samples them one step at a time. A stand-in graph runner that never replays
    (max_batch 0) shows the engine's choice on CPU."""
    prompts, params = [], []
    rng = random.Random(3)
    for index in range(6):
        messages, candidates = product_prompt(index, rng)
        prompts.append(messages)
        params.append(SamplingParams(max_tokens=80, json_schema=catalogue_schema(candidates).json_schema))
    eager = LLM(engine_checkpoint)
    assert eager.engine.jump_forward
    monkeypatch.setattr(LLMEngine, "_decode_graphs", lambda self: SimpleNamespace(max_batch=0))
    with_graphs = LLM(engine_checkpoint)
    assert not with_graphs.engine.jump_forward
    outputs_eager, outputs_graphs = eager.chat(prompts, params), with_graphs.chat(prompts, params)
    assert [o.token_ids for o in outputs_graphs] == [o.token_ids for o in outputs_eager]
    assert eager.engine.stats.num_jump_forward_tokens > 0 and with_graphs.engine.stats.num_jump_forward_tokens == 0


def test_bad_requests_fail_alone(engine_checkpoint, tmp_path):
    llm = LLM(engine_checkpoint, max_model_len=200, max_images_per_prompt=2)
    whole = noise_image(64, 64, seed=9, fmt="JPEG")
    (tmp_path / "photo.png").write_bytes(noise_image(40, 40, seed=3, fmt="PNG"))
    with Image.open(tmp_path / "photo.png") as closed:  # lazy: its pixels were never read while open
        pass
    bad = [
        [{"role": "user", "content": "word " * 300}],  # longer than max_model_len
        [{"role": "user", "content": [{"type": "image", "image": noise_image(40, 40, seed=i)} for i in range(3)]}],
        [{"role": "user", "content": [{"type": "image", "image": b"\\x89PNG garbage"}]}],
        [{"role": "user", "content": [{"type": "image", "image": whole[: len(whole) * 2 // 3]}]}],  # fails at decode
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.jpg"}}]}],
        [{"role": "user", "content": "fine"}],  # bad schema below
        [{"role": "user", "content": [{"type": "image", "image": tmp_path / "photo.png"}]}],  # a path: not read
        [{"role": "user", "content": [{"type": "image", "image": closed}]}],
    ]
    good = mixed_conversations(3)
    params = [SamplingParams(max_tokens=4)] * 5 + [SamplingParams(max_tokens=4, json_schema={"type": "nonsense"})]
    params += [SamplingParams(max_tokens=4)] * 2
    outputs = llm.chat(bad + good, params + [SamplingParams(max_tokens=4, ignore_eos=True)] * 3)
    errors = [o.error for o in outputs[: len(bad)]]
    assert all(o.finish_reason == "error" for o in outputs[: len(bad)]), errors
    assert "max_model_len is 200" in errors[0]
    assert "at most 2 are allowed" in errors[1]
    assert "could not be decoded" in errors[3]
    assert "remote image URLs" in errors[4]
    assert "schema" in errors[5].lower()
    assert "got PosixPath (files are not read" in errors[6]
    assert "pixels cannot be loaded" in errors[7]
    assert [o.finish_reason for o in outputs[len(bad):]] == ["length"] * 3
    assert all(len(o.token_ids) == 4 for o in outputs[len(bad):])
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_a_prompt_with_token_ids_outside_the_vocabulary_fails_alone(llm):
    good = llm.engine.processor.process(conversation(4, words=3))
    bad = replace(good, token_ids=list(good.token_ids) + [llm.engine.model_config.text.vocab_size])
    outputs = llm.generate([good, bad, good], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [o.finish_reason for o in outputs] == ["length", "error", "length"]
    assert "outside the vocabulary" in outputs[1].error


def test_calls_from_two_threads_run_one_after_another_with_the_serial_answers(llm):
    prompts = [mixed_conversations(6), [conversation(20 + i, words=4 + i) for i in range(6)]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    serial = [[o.token_ids for o in llm.chat(p, params)] for p in prompts]
    answers: list = [None, None]

    def call(index: int) -> None:
        answers[index] = [o.token_ids for o in llm.chat(prompts[index], params)]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == serial  # before the lock: a KeyError in one thread, other tokens in the other


def test_the_wrong_kind_of_argument_is_refused_before_any_work(llm):
    with pytest.raises(TypeError, match="chat.. takes a conversation .* got a str"):
        llm.chat("hello")  # would have been five one-character conversations
    with pytest.raises(TypeError, match="generate.. takes a list of ProcessedPrompt .* got a str"):
        llm.generate("hi")
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them, got a dict"):
        llm.chat([conversation(1)], {"max_tokens": 4})
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams, got a dict"):
        llm.extract([], sampling_params={"max_tokens": 4})


def test_stop_strings_stop_tokens_and_logprobs(llm):
    messages = [conversation(2, words=5)]
    free = llm.chat(messages, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert len(free.token_ids) == 24 and free.finish_reason == "length"
    stop_token = free.token_ids[5]
    by_token = llm.chat(messages, SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[stop_token]))[0]
    first = free.token_ids.index(stop_token)
    assert by_token.token_ids == free.token_ids[: first + 1] and by_token.finish_reason == "stop"
    stop_text = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    if stop_text.strip():
        by_string = llm.chat(messages, SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop_text]))[0]
        assert by_string.finish_reason == "stop" and stop_text not in by_string.text
        assert free.text.startswith(by_string.text)
    with_logprobs = llm.chat(messages, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3))[0]
    assert len(with_logprobs.logprobs) == 6
    for token, entry in zip(with_logprobs.token_ids, with_logprobs.logprobs):
        assert token in entry and len(entry) >= 3
        assert entry[token] == max(entry.values())  # greedy picks the most likely token
    # constrained, an entry per token too: before, the tokens jump-forward forced had none (150 tokens, 148 entries)
    constrained = SamplingParams(max_tokens=60, json_schema=ProductMetadata, logprobs=1)
    answer = llm.chat(messages, constrained)[0]
    assert answer.finish_reason in ("stop", "length") and len(answer.logprobs) == len(answer.token_ids)
    assert all(token in entry for token, entry in zip(answer.token_ids, answer.logprobs))
    without = llm.chat(messages, SamplingParams(max_tokens=60, json_schema=ProductMetadata))[0]
    assert without.token_ids == answer.token_ids  # the same answer, forced tokens sampled one by one
    # stops beside a constraint would cut the answer before it matches: refused, the end-of-answer tokens aside
    with pytest.raises(SamplingParamsError, match="stop strings cannot be combined"):
        SamplingParams(json_schema=ProductMetadata, stop=[","])
    cut, ended = llm.chat([messages[0]] * 2, [
        SamplingParams(max_tokens=60, json_schema=ProductMetadata, stop_token_ids=[free.token_ids[0]]),
        SamplingParams(max_tokens=60, json_schema=ProductMetadata, stop_token_ids=sorted(llm.engine.eos_token_ids))])
    assert cut.finish_reason == "error" and "cannot be combined with json_schema" in cut.error
    assert ended.token_ids == without.token_ids


def test_no_leaks_after_thousands_of_requests_with_aborts(engine_checkpoint):
    llm = LLM(engine_checkpoint, block_size=4, kv_cache_memory_bytes=512 * 2048, max_num_seqs=64)
    engine = llm.engine
    finished = run_waves_with_aborts(engine, waves=25, per_wave=100, rng=random.Random(0))
    assert finished == 2500
    assert engine.requests == {} and engine.detokenizers == {}
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    assert set(engine.block_manager.ref_counts) == {0}
    assert engine.scheduler.num_unfinished == 0


def test_final_only_outputs_come_once_and_match_cumulative(llm):
    """`output_kind="final_only"`: no output until the request ends, then the same answer
    (text, tokens, finish reason) as a streamed request gives."""
    engine = llm.engine
    messages = conversation(4, images=1, words=5)
    seen: dict[str, list] = {}
    for kind in ("cumulative", "final_only"):
        request_id = engine.add_request(messages, SamplingParams(max_tokens=12, ignore_eos=True, output_kind=kind))
        seen[kind] = []
        while engine.has_unfinished_requests():
            seen[kind].extend(output for output in engine.step() if output.request_id == request_id)
    assert len(seen["cumulative"]) == 12  # one per generated token
    assert [output.finished for output in seen["final_only"]] == [True]
    streamed, final = seen["cumulative"][-1], seen["final_only"][0]
    assert (final.text, final.token_ids, final.finish_reason) == (streamed.text, streamed.token_ids, "length")
    assert final.delta_text == final.text  # nothing was handed out before
    with pytest.raises(SamplingParamsError, match="output_kind must be one of cumulative, final_only"):
        SamplingParams(output_kind="delta")


def test_grammars_compiling_too_long_time_out_and_aborted_ones_are_forgotten(engine_checkpoint, monkeypatch):
    """Each step polls the compiles its requests await; a request
    whose compile outlives grammar_compile_timeout_s fails alone."""
    from concurrent.futures import Future

    from vlm_catalog.engine.llm_engine import LLMEngine

    engine = LLMEngine(model=engine_checkpoint, grammar_compile_timeout_s=0.2)
    stuck, controlled = Future(), Future()
    futures = iter([stuck, controlled])
    monkeypatch.setattr(engine, "_submit_grammar", lambda params: next(futures))
    constrained = SamplingParams(max_tokens=3, json_schema={"type": "object"})
    slow = engine.add_request(conversation(1), constrained)
    aborted = engine.add_request(conversation(2), constrained)
    plain = engine.add_request(conversation(3), SamplingParams(max_tokens=3, ignore_eos=True))
    assert engine.abort(aborted)
    controlled.set_exception(RuntimeError("never read: the request was aborted"))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finished[slow].finish_reason == "error" and "timed out" in finished[slow].error
    assert finished[aborted].finish_reason == "abort"
    assert finished[plain].finish_reason == "length"
    assert engine._awaiting_grammar == {}
    engine.close()


def test_an_id_reused_after_an_abort_during_its_compile_is_answered(engine_checkpoint, monkeypatch):
    """Before, the aborted request's compile ending late took the new request's place in the
    queue of those awaiting a grammar (keyed by id): the new one was never scheduled, never
    answered, and its id refused for good ("already in use")."""
    from concurrent.futures import Future

    engine = LLMEngine(model=engine_checkpoint)
    compile_for_real, first = engine._submit_grammar, Future()
    submitted = iter([lambda params: first, compile_for_real])
    monkeypatch.setattr(engine, "_submit_grammar", lambda params: next(submitted)(params))
    constrained = SamplingParams(max_tokens=8, json_schema={"type": "object"})
    engine.add_request(conversation(1), constrained, "job-1")
    assert engine.abort("job-1")
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [("job-1", "abort")]
    engine.add_request(conversation(2), constrained, "job-1")
    first.set_exception(RuntimeError("never read: the request was aborted"))  # the old compile ends late
    finished, give_up = [], time.monotonic() + 60
    while engine.has_unfinished_requests() and time.monotonic() < give_up:
        finished += [(o.request_id, o.finish_reason) for o in engine.step() if o.finished]
    assert finished in ([("job-1", "length")], [("job-1", "stop")])
    assert engine.requests == {} and engine._awaiting_grammar == {}
    engine.close()


def test_a_cached_grammar_does_not_keep_finished_requests_alive(engine_checkpoint):
    """The compiled grammar stays cached for the next request with that schema; before, its
    future kept a done-callback that held each request (prompt, images) which had awaited it."""
    import gc
    import weakref

    engine = LLMEngine(model=engine_checkpoint)
    request_id = engine.add_request(conversation(1), SamplingParams(max_tokens=4, json_schema={"type": "object"}))
    request = weakref.ref(engine.requests[request_id])
    while engine.has_unfinished_requests():
        engine.step()
    gc.collect()
    assert engine.requests == {} and request() is None
    engine.close()


def test_a_grammar_queued_behind_a_slow_compile_does_not_time_out_for_it(engine_checkpoint, monkeypatch):
    """The timeout counts from the start of a request's own compile. Before, it counted from the
    request's arrival: one schema that compiled for a minute (thousands of optional properties)
    timed out every constrained request queued behind it on the one compile thread."""

    from vlm_catalog.engine.llm_engine import LLMEngine

    engine = LLMEngine(model=engine_checkpoint, grammar_compile_timeout_s=0.5, grammar_compile_workers=1)
    service = engine.grammar_service
    compile_for_real = service._compile_with_xgrammar

    def slow_for_one(spec):
        if "slow" in (spec.json_schema or ""):
            time.sleep(1.5)
        return compile_for_real(spec)

    monkeypatch.setattr(service, "_compile_with_xgrammar", slow_for_one)
    slow_schema = {"type": "object", "properties": {"slow": {"type": "integer"}}, "required": ["slow"]}
    slow = engine.add_request(conversation(1), SamplingParams(max_tokens=20, json_schema=slow_schema))
    behind = engine.add_request(conversation(2), SamplingParams(max_tokens=40, json_schema=ProductMetadata))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finished[slow].finish_reason == "error" and "timed out" in finished[slow].error
    assert finished[behind].finish_reason in ("stop", "length"), finished[behind].error
    engine.close()


def test_a_constrained_request_is_queued_for_scheduling_once_its_grammar_is_compiled(engine_checkpoint, monkeypatch):
    from concurrent.futures import Future

    from vlm_catalog.engine.llm_engine import LLMEngine

    engine = LLMEngine(model=engine_checkpoint)
    compile_for_real, gate = engine._submit_grammar, Future()

    def held_back(params):  # the real compile, handed over only when the gate opens
        compiled, handed = compile_for_real(params), Future()
        gate.add_done_callback(lambda _: handed.set_result(compiled.result()))
        return handed

    monkeypatch.setattr(engine, "_submit_grammar", held_back)
    request_id = engine.add_request(conversation(4), SamplingParams(max_tokens=40, json_schema=ProductMetadata.model_json_schema()))
    request = engine.requests[request_id]
    for _ in range(3):
        assert engine.step() == []
        assert request not in engine.scheduler.waiting and request not in engine.scheduler.running
        assert engine.has_unfinished_requests() and engine.load_stats()["requests_waiting"] == 1
    gate.set_result(None)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outputs] == [request_id] and outputs[0].finish_reason in ("stop", "length")
    assert request.grammar is not None and engine.load_stats()["requests_waiting"] == 0
    engine.close()


def test_grammars_compile_on_the_configured_threads_half_the_cpus_by_default(engine_checkpoint, monkeypatch):
    from vlm_catalog.engine.config import MAX_AUTO_GRAMMAR_WORKERS, EngineConfig, EngineConfigError
    from vlm_catalog.engine.llm_engine import LLMEngine

    for cpus, workers in ((1, 1), (2, 1), (16, 8), (64, MAX_AUTO_GRAMMAR_WORKERS), (None, 1)):
        monkeypatch.setattr("os.cpu_count", lambda cpus=cpus: cpus)
        assert EngineConfig().grammar_workers() == workers, cpus
    assert EngineConfig(grammar_compile_workers=3).grammar_workers() == 3
    with pytest.raises(EngineConfigError, match="grammar_compile_workers must be at least 1"):
        EngineConfig(grammar_compile_workers=0)
    engine = LLMEngine(model=engine_checkpoint, grammar_compile_workers=3)
    assert engine.grammar_service.workers == 3
    engine.close()



def test_the_engine_reads_the_tuned_tables_at_start_and_refuses_a_broken_one(engine_checkpoint, monkeypatch, tmp_path):
    """The tuned-settings table VLM_CATALOG_TUNED_CONFIGS names is read when the engine starts (and
    reported as `tuned_tables`); a broken one stops the start with an error naming the file and
    the entry, before the model loads, instead of failing the first forward pass."""
    from kernels import tuned_configs
    from kernels.moe.configs import MoeKernelConfig
    from vlm_catalog.engine.config import EngineConfigError

    monkeypatch.setattr(tuned_configs, "TABLES_DIR", tmp_path / "packaged")  # no packaged table for any device
    tuned_configs.clear_cache()
    monkeypatch.delenv(tuned_configs.TUNED_CONFIGS_ENV_VAR, raising=False)
    engine = LLMEngine(model=engine_checkpoint)
    assert engine.tuned_tables == ()
    engine.close()
    table = tuned_configs.write_entries(tmp_path / "tuned.json", None, moe=[tuned_configs.moe_entry(
        (4, 64, 32, "float32", 16), MoeKernelConfig(16, 32, 64, 1, 4, 2, tuned=True), 0.1, 0.2)])
    monkeypatch.setenv(tuned_configs.TUNED_CONFIGS_ENV_VAR, str(table))
    engine = LLMEngine(model=engine_checkpoint)
    assert engine.tuned_tables == (str(table),)
    engine.close()
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": 1, "paged_decode": [{"kv_dtype": "float32", "head_dim": 16, "batch": 3, '
                      '"config": {"block_n": 16}}]}')
    monkeypatch.setenv(tuned_configs.TUNED_CONFIGS_ENV_VAR, str(broken))
    monkeypatch.setattr("vlm_catalog.engine.llm_engine.load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(EngineConfigError, match=f"tuned table {broken}: paged_decode entry 0: batch=3"):
        LLMEngine(model=engine_checkpoint)
    tuned_configs.clear_cache()


def test_a_context_longer_than_the_model_was_made_for_is_refused_at_start(engine_checkpoint):
    from vlm_catalog.engine.config import EngineConfigError
    from vlm_catalog.model.config import ModelConfig

    longest = ModelConfig.from_pretrained(engine_checkpoint).text.max_position_embeddings
    assert longest == 128000  # transformers' default for Qwen3-VL-MoE, which the test checkpoint keeps
    # 10**9 used to fail allocating a 74.5 GiB block table, after the weights had loaded
    for too_long in (longest + 1, 10**9):
        with pytest.raises(EngineConfigError, match=f"max_model_len {too_long} is more than .*\\({longest}\\)"):
            LLMEngine(EngineConfig(model=engine_checkpoint, max_model_len=too_long))


@pytest.mark.parametrize(("name", "value", "message"), [
    ("max_num_seqs", "4", "max_num_seqs must be an integer, got '4'"),
    ("block_size", 16.0, "block_size must be an integer, got 16.0"),
    ("max_model_len", True, "max_model_len must be an integer, got True"),
    ("max_num_batched_tokens", 0, "max_num_batched_tokens must be at least 1, got 0"),
])
def test_engine_sizes_must_be_integers(name, value, message):
    from vlm_catalog.engine.config import EngineConfigError

    with pytest.raises(EngineConfigError, match=message):  # before: "4" passed, to fail inside a step
        EngineConfig(**{name: value})


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_preempted_request_recomputed_one_token_at_a_time_keeps_every_row_its_own(async_scheduling):
    """A budget of 5 tokens cuts a preempted request's recompute into one-token chunks that stop short of
    its last token. Such a chunk counted as a decode, and the runner gives every decode a logits row, which
    the engine (sampling only chunks that reach their last token) did not expect: each later request took
    the row of the one before it (sync: a wrong greedy token; async: `ValueError: 1 requests but tokens of
    shape (2,)`). The case was found by a scheduler-only search: prompts of 19, 7 and 8 tokens."""
    from vlm_catalog.paths import DEFAULT_MODEL_DIR
    from vlm_catalog.preprocess.processor import ProcessedPrompt

    model = DEFAULT_MODEL_DIR  # the shipped model: 2048 bytes of KV cache per token
    requests = [(19, 13), (7, 12), (8, 6)]  # (prompt tokens, max_tokens)

    def prompt(length: int) -> ProcessedPrompt:
        return ProcessedPrompt([100 + j % 7 for j in range(length)], [], [])

    def run(engine: LLMEngine) -> dict[str, list[int]]:
        for index, (length, max_tokens) in enumerate(requests):
            engine.add_request(prompt(length), SamplingParams(max_tokens=max_tokens, ignore_eos=True), f"r{index}")
        answers = {}
        while engine.has_unfinished_requests():
            answers.update({output.request_id: output.token_ids for output in engine.step() if output.finished})
        return answers

    solo = {}
    for index, (length, max_tokens) in enumerate(requests):
        engine = LLMEngine(EngineConfig(model=model, async_scheduling=False))
        engine.add_request(prompt(length), SamplingParams(max_tokens=max_tokens, ignore_eos=True), "solo")
        while engine.has_unfinished_requests():
            solo.update({f"r{index}": output.token_ids for output in engine.step() if output.finished})
    tight = LLMEngine(EngineConfig(model=model, block_size=4, kv_cache_memory_bytes=40 * 2048,
                                   max_num_batched_tokens=5, max_num_seqs=8, async_scheduling=async_scheduling))
    assert tight.num_blocks == 10  # 40 tokens: the three requests cannot all hold their blocks
    short_recomputes = []
    execute = tight.runner.execute

    def watched(chunks, *args, **kwargs):
        short_recomputes.extend(chunk for chunk in chunks if chunk.num_tokens == 1 and chunk.past_prompt
                                and not chunk.samples)
        return execute(chunks, *args, **kwargs)

    tight.runner.execute = watched
    assert run(tight) == solo
    assert tight.stats.num_preemptions and short_recomputes  # the case this test is about happened
    assert tight.block_manager.num_free_blocks == tight.num_blocks


@pytest.fixture(scope="module")
def shipped():
    from vlm_catalog.paths import DEFAULT_MODEL_DIR

    return LLM(DEFAULT_MODEL_DIR)


@pytest.mark.parametrize("filters", [{}, {"seed": 3}, {"top_k": 5}, {"top_p": 0.9}])
def test_a_vanishing_temperature_is_greedy(shipped, filters):
    """temperature=1e-38 is valid (the service takes 0..2): the logits divided by it overflowed to inf, the
    softmax gave NaN and the draw took token V, past the vocabulary (the next step's IndexError), or with
    top-k/top-p raised for the whole step. Below 1e-5 it is greedy, as in vLLM."""
    messages = [[{"role": "user", "content": "hello there"}]]
    greedy = shipped.chat(messages, SamplingParams(max_tokens=8, ignore_eos=True))[0]
    tiny = shipped.chat(messages, SamplingParams(max_tokens=8, ignore_eos=True, temperature=1e-38, **filters))[0]
    assert tiny.finish_reason == "length" and tiny.token_ids == greedy.token_ids


def test_a_row_of_nan_logits_draws_a_token_of_the_vocabulary():
    """The sampler's backstop: NaN probabilities found no column and gave token V, which failed the next step."""
    import torch

    from vlm_catalog.engine.sampler import sample

    logits = torch.full((2, 50), float("nan"))
    logits[1] = torch.arange(50.0)
    for filters in ({}, {"top_k": 5}, {"top_p": 0.9}):
        tokens = sample(logits.clone(), [SamplingParams(temperature=1.0, **filters)] * 2, [0, 0]).token_ids
        assert all(0 <= token < 50 for token in tokens), (filters, tokens)


@pytest.mark.parametrize("failing_step", [1, 3], ids=["prefill", "decode"])
def test_after_a_step_whose_sampling_raised_its_requests_go_on(engine_checkpoint, monkeypatch, failing_step):
    """Sampling that raises (a bug, a device error) left each request of the step with nothing to compute
    and no token: it never finished, and `while has_unfinished_requests(): step()` never ended. Its last
    token is now computed again, and the answers are those of a run without the failure."""
    from vlm_catalog.engine import llm_engine

    prompts = [conversation(index, words=4) for index in range(3)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = [output.token_ids for output in LLM(engine_checkpoint).chat(prompts, params)]
    engine = LLMEngine(EngineConfig(model=engine_checkpoint))
    for index, messages in enumerate(prompts):
        engine.add_request(messages, params, f"r{index}")
    real_sample = llm_engine.LLMEngine._sample_and_append
    calls = {"n": 0}

    def fails_once(self, chunks, logits):
        calls["n"] += 1
        if calls["n"] == failing_step:
            raise RuntimeError("the sampler failed")
        return real_sample(self, chunks, logits)

    monkeypatch.setattr(llm_engine.LLMEngine, "_sample_and_append", fails_once)
    answers, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 100, "the requests of the failed step never finished"
        try:
            outputs = engine.step()
        except RuntimeError as exc:
            assert str(exc) == "the sampler failed"
            continue
        answers.update({output.request_id: output.token_ids for output in outputs if output.finished})
    assert [answers[f"r{index}"] for index in range(3)] == expected
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    clean = LLMEngine(EngineConfig(model=engine_checkpoint))  # the recomputed tokens are counted once
    monkeypatch.setattr(llm_engine.LLMEngine, "_sample_and_append", real_sample)
    for index, messages in enumerate(prompts):
        clean.add_request(messages, params, f"r{index}")
    while clean.has_unfinished_requests():
        clean.step()
    for counter in ("num_prompt_tokens_computed", "num_output_tokens_computed"):
        assert getattr(engine.stats, counter) == getattr(clean.stats, counter), counter


def test_a_kv_pool_the_memory_cannot_hold_is_a_config_error_naming_the_settings(engine_checkpoint, monkeypatch):
    """`--max-num-seqs 100000000` or a KV budget past the host's memory ended in an allocator's traceback."""
    from vlm_catalog.engine import llm_engine
    from vlm_catalog.engine.config import EngineConfigError

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8000000000 bytes.")

    monkeypatch.setattr(llm_engine, "allocate_kv_caches", no_memory)
    with pytest.raises(EngineConfigError, match=r"not enough memory for the KV cache of \d+ tokens .*"
                                                r"DefaultCPUAllocator.*lower kv_cache_memory_bytes .* or max_num_seqs"):
        LLMEngine(EngineConfig(model=engine_checkpoint))
