"""Random schedules against solo runs.

A service sees requests arrive between steps, clients abort them, the pool runs short and
preempts, prompts are chunked, images and prefixes are shared, and some requests are bad. None
of that may change an answer: every request that is not aborted must get exactly what it gets
alone on a fresh engine (greedy or seeded sampling, stop strings, stop tokens, logprobs,
grammars with and without jump-forward, image errors), and the engine must end with every
block free. Each case fixes the engine settings it exercises and draws the schedule from a seed;
its counters must show the settings did their work (preemptions, prefix hits, forced tokens,
aborts), so a change that stops exercising them fails here rather than passing unseen.
"""

import math
import random

import pytest

from tests.engine.test_engine_behaviour import product_prompt
from tests.model.helpers import noise_image
from vlm_catalog import LLM, SamplingParams
from vlm_catalog.engine.llm_engine import EngineRequestError
from vlm_catalog.structured import catalogue_schema

IMAGES = [noise_image(48 + 37 * k, 40 + 23 * (k % 3), seed=k) for k in range(4)]
SHARED_PREFIX = "a long shared prefix of product boilerplate " * 6
LOGPROB_TOLERANCE = 1e-3  # a row's log-softmax in another batch may differ in the last float32 bits

# settings: what the engine runs with; exercised: counters that must be non-zero afterwards
CASES = {
    "async, a pool that preempts, chunks of 64": dict(
        settings=dict(async_scheduling=True, block_size=4, kv_cache_memory_bytes=120 * 2048,
                      max_num_batched_tokens=64, max_num_seqs=8),
        exercised=("preemptions", "aborts")),
    "sync, prefix caching, jump-forward, shortest prompt first": dict(
        settings=dict(async_scheduling=False, block_size=4, enable_jump_forward=True,
                      scheduling_policy="shortest_prompt_first", max_num_batched_tokens=128, max_num_seqs=32),
        exercised=("prefix_hits", "forced_tokens", "aborts")),
    "async, jump-forward, an encoder cache of one image, three sequences": dict(
        settings=dict(async_scheduling=True, enable_jump_forward=True, encoder_cache_tokens=200,
                      max_num_batched_tokens=512, max_num_seqs=3),
        exercised=("forced_tokens", "aborts")),
    "sync, no prefix cache, a pool that preempts": dict(
        settings=dict(async_scheduling=False, block_size=16, enable_prefix_caching=False,
                      kv_cache_memory_bytes=200 * 2048, max_num_batched_tokens=64, max_num_seqs=8),
        exercised=("preemptions", "aborts")),
}
KINDS = ("text", "image", "two_images", "shared_prefix", "schema", "stops", "not_an_image", "truncated_image")


def random_request(rng: random.Random, index: int) -> tuple[list[dict], SamplingParams]:
    kind = rng.choice(KINDS)
    sampling = {"temperature": 0.9, "top_p": 0.9, "seed": index} if rng.random() < 0.5 else {}
    if kind == "schema":
        messages, candidates = product_prompt(index, rng)
        schema = catalogue_schema(candidates).json_schema
        schema["properties"]["brand"]["maxLength"] = 6  # a random model's answers then finish
        return messages, SamplingParams(max_tokens=rng.randrange(10, 60), json_schema=schema, **sampling)
    content = []
    if kind in ("image", "two_images"):
        content += [{"type": "image", "image": rng.choice(IMAGES)} for _ in range(1 + (kind == "two_images"))]
    elif kind == "not_an_image":
        content.append({"type": "image", "image": bytes(rng.randrange(256) for _ in range(64))})
    elif kind == "truncated_image":
        whole = IMAGES[index % len(IMAGES)]
        content.append({"type": "image", "image": whole[: len(whole) // 2]})
    text = " ".join(f"w{rng.randrange(40)}" for _ in range(rng.randrange(2, 40)))
    content.append({"type": "text", "text": SHARED_PREFIX + text if kind == "shared_prefix" else text})
    if kind == "stops":
        sampling.update(stop=[f"w{rng.randrange(40)}", "e"], stop_token_ids=[rng.randrange(1000)],
                        logprobs=rng.choice([None, 2]))
    params = SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=rng.random() < 0.7, **sampling)
    return [{"role": "user", "content": content}], params


def answer(output) -> tuple:
    """What must not depend on the schedule: tokens, text, finish reason, error, logprobs' tokens."""
    logprob_tokens = tuple(tuple(sorted(step)) for step in output.logprobs or [])
    return tuple(output.token_ids), output.text, output.finish_reason, output.error, logprob_tokens


def logprob_values(output) -> list[float]:
    return [float(getattr(value, "logprob", value)) for step in output.logprobs or []
            for _, value in sorted(step.items())]


def run_random_schedule(llm: LLM, seed: int, num_requests: tuple[int, int] = (12, 24)) -> dict:
    """Add the seed's requests (a count drawn from `num_requests`, end excluded) a few at a time
    between steps, abort about one step in ten, and step to the end. Returns the requests,
    {request index: final output, or the add_request error's message} and the indices aborted."""
    rng = random.Random(seed)
    engine = llm.engine
    requests = [random_request(rng, index) for index in range(rng.randrange(*num_requests))]
    results: dict[int, object] = {}
    aborted: set[int] = set()
    waiting = list(range(len(requests)))
    for _ in range(2000):
        if not waiting and not engine.has_unfinished_requests():
            break
        for _ in range(rng.randrange(0, 4)):
            if waiting:
                index = waiting.pop(0)
                try:
                    engine.add_request(*requests[index], f"r{index}")
                except EngineRequestError as exc:  # bad input fails that request alone, at once
                    results[index] = str(exc)
        live = [request_id for request_id in engine.requests if int(request_id[1:]) not in aborted]
        if live and rng.random() < 0.1:
            victim = rng.choice(live)
            if engine.abort(victim):
                aborted.add(int(victim[1:]))
        for output in engine.step():
            if output.finished:
                results[int(output.request_id[1:])] = output
    else:
        raise AssertionError("the schedule did not finish in 2000 steps")
    return {"requests": requests, "results": results, "aborted": aborted}


@pytest.fixture(scope="module")
def solo(engine_checkpoint):
    """One request at a time on default settings: the answers a schedule must not change."""
    return LLM(engine_checkpoint, async_scheduling=False)


def check_against_solo(run: dict, solo: LLM, pool_tokens: int) -> int:
    """Every request not aborted answers as it does alone; returns how many were compared."""
    compared = 0
    for index, (messages, params) in enumerate(run["requests"]):
        if index in run["aborted"]:
            continue
        got = run["results"][index]
        if isinstance(got, str):  # refused by add_request
            if "the pool holds" in got:  # longer than this engine's pool (the solo one's is larger)
                assert pool_tokens < 4096, got
                continue
            expected = solo.chat([messages], params)[0]
            assert expected.finish_reason == "error" and expected.error == got, (index, got, expected.error)
            continue
        expected = solo.chat([messages], params)[0]
        assert answer(got) == answer(expected), (index, params)
        assert all(math.isclose(a, b, abs_tol=LOGPROB_TOLERANCE)
                   for a, b in zip(logprob_values(got), logprob_values(expected))), index
        compared += 1
    return compared


def check_case(engine_checkpoint, solo, case: str, seeds) -> None:
    llm = LLM(engine_checkpoint, **CASES[case]["settings"])
    engine = llm.engine
    compared = aborts = 0
    for seed in seeds:
        run = run_random_schedule(llm, seed)
        assert engine.block_manager.num_free_blocks == engine.num_blocks, f"seed {seed}: blocks left in use"
        compared += check_against_solo(run, solo, engine.num_blocks * engine.config.block_size)
        aborts += len(run["aborted"])
    assert compared >= 5 * len(seeds)
    totals = {"preemptions": engine.stats.num_preemptions, "forced_tokens": engine.stats.num_jump_forward_tokens,
              "prefix_hits": engine.cache_stats()["prefix_cache_hit_blocks"], "aborts": aborts}  # over every seed
    missing = [key for key in CASES[case]["exercised"] if not totals[key]]
    assert not missing, f"{case}: the schedules never exercised {missing} ({totals})"


@pytest.mark.parametrize("case", list(CASES))
def test_random_schedules_answer_as_solo_runs(engine_checkpoint, solo, case):
    check_case(engine_checkpoint, solo, case, seeds=(1, 2))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_many_random_schedules_answer_as_solo_runs(engine_checkpoint, solo, case):
    check_case(engine_checkpoint, solo, case, seeds=range(10, 22))
