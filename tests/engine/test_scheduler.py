"""Scheduler: chunked prefill, running-first, limits, preemption by recompute, policies, prefix hits."""

from vlm_catalog.engine.block_manager import BlockManager
from vlm_catalog.engine.request import FinishReason, Request, RequestStatus
from vlm_catalog.engine.sampling_params import SamplingParams
from vlm_catalog.engine.scheduler import Scheduler
from vlm_catalog.preprocess.image import ImageProbe
from vlm_catalog.preprocess.processor import ProcessedPrompt


def make_request(request_id, num_tokens, max_tokens=8, first_token=1):
    token_ids = [first_token + i % 7 for i in range(num_tokens)]
    prompt = ProcessedPrompt(token_ids, [], [])
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), max_model_len=4096)


def run_step(scheduler, new_token=42):
    """Schedule, pretend to run the model, append a token to each sampling request."""
    output = scheduler.schedule()
    scheduler.update_after_step(output)
    for chunk in output.chunks:
        if chunk.samples:
            chunk.request.append_tokens([new_token])
            if chunk.request.num_output_tokens >= chunk.request.params.max_tokens:
                scheduler.finish(chunk.request, FinishReason.LENGTH)
    return output


def test_chunked_prefill_runs_beside_decodes():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    short = make_request("short", 3)
    scheduler.add(short)
    assert [(c.request.request_id, c.start, c.num_tokens) for c in run_step(scheduler).chunks] == [("short", 0, 3)]
    scheduler.add(make_request("long", 20))
    steps = [[(c.request.request_id, c.start, c.num_tokens, c.samples) for c in run_step(scheduler).chunks] for _ in range(3)]
    assert steps == [
        [("short", 3, 1, True), ("long", 0, 7, False)],  # the decode goes first; the prefill takes the rest
        [("short", 4, 1, True), ("long", 7, 7, False)],
        [("short", 5, 1, True), ("long", 14, 6, True)],  # last chunk of the prompt samples
    ]


def test_max_num_seqs_and_budget():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        scheduler.add(make_request(f"r{i}", 5, first_token=1 + 10 * i))  # distinct prompts: no shared blocks
    output = run_step(scheduler)
    assert [c.request.request_id for c in output.chunks] == ["r0", "r1"]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]
    assert output.num_batched_tokens == 10


def test_preemption_recomputes_without_losing_outputs():
    # 6 blocks of 2 tokens; each request grows to 4 + 6 = 10 tokens (5 blocks): one fits, two don't
    scheduler = Scheduler(BlockManager(6, 2, enable_prefix_caching=False), max_num_seqs=4, max_num_batched_tokens=64)
    first, second = make_request("first", 4, max_tokens=6), make_request("second", 4, max_tokens=6)
    scheduler.add(first)
    scheduler.add(second)
    preempted = []
    while not preempted:  # 4 + 2 tokens each fill the 6 blocks; the 7th token needs a 4th block each
        preempted = run_step(scheduler).preempted
    assert preempted == ["second"]  # the most recently admitted running request gives way
    assert second.metrics.num_preemptions == 1 and second.status is RequestStatus.WAITING
    assert second.num_computed_tokens == 0 and second.num_output_tokens == 3  # outputs kept
    outputs_before = second.output_token_ids
    while not second.is_finished:
        run_step(scheduler)
    assert second.output_token_ids[: len(outputs_before)] == outputs_before
    assert first.num_output_tokens == second.num_output_tokens == 6
    assert scheduler.block_manager.num_free_blocks == 6


def test_request_larger_than_the_pool_fails_instead_of_looping():
    scheduler = Scheduler(BlockManager(4, 2), max_num_seqs=4, max_num_batched_tokens=64)
    huge, grower = make_request("huge", 9), make_request("grower", 6, max_tokens=10)
    scheduler.add(huge)
    scheduler.add(grower)
    for _ in range(20):
        if not scheduler.has_unfinished():
            break
        run_step(scheduler)
    assert huge.finish_reason is FinishReason.ERROR and "whole pool holds 8" in huge.error
    assert grower.finish_reason is FinishReason.ERROR  # grew past 8 tokens alone
    assert grower.num_output_tokens == 3 and not scheduler.has_unfinished()  # the 9th token did not fit


def test_shortest_prompt_first_policy():
    for policy, expected in (("fcfs", ["a", "b", "c"]), ("shortest_prompt_first", ["c", "a", "b"])):
        scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=1, max_num_batched_tokens=100, policy=policy)
        for request_id, length in (("a", 9), ("b", 12), ("c", 3)):
            scheduler.add(make_request(request_id, length, max_tokens=1))
        order = []
        while scheduler.has_unfinished():
            order += [c.request.request_id for c in run_step(scheduler).chunks]
        assert order == expected


def test_prefix_cache_hit_skips_shared_blocks_but_computes_the_last_token():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=100)
    first = make_request("first", 12, max_tokens=1)
    scheduler.add(first)
    run_step(scheduler)
    assert first.is_finished
    twin = make_request("twin", 12, max_tokens=1)  # same 12 tokens: 3 full blocks cached
    scheduler.add(twin)
    chunk = run_step(scheduler).chunks[0]
    assert (chunk.start, chunk.num_tokens) == (8, 4)  # 2 blocks reused; the last block recomputed
    assert twin.metrics.num_cached_tokens == 8
    other = make_request("other", 12, max_tokens=1, first_token=3)
    scheduler.add(other)
    assert run_step(scheduler).chunks[0].start == 0


def test_twins_arriving_together_wait_for_the_shared_blocks_instead_of_recomputing_them():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=100)
    first, twin = make_request("first", 12, max_tokens=2), make_request("twin", 12, max_tokens=2)
    other = make_request("other", 12, max_tokens=2, first_token=3)
    for request in (first, twin, other):
        scheduler.add(request)
    step1 = run_step(scheduler)
    # the twin's first block is being computed by `first`: it waits; `other` shares nothing and goes
    assert [(c.request.request_id, c.start, c.num_tokens) for c in step1.chunks] == [("first", 0, 12), ("other", 0, 12)]
    assert [r.request_id for r in scheduler.waiting] == ["twin"]
    first_blocks = list(scheduler.block_manager.block_table("first"))
    step2 = run_step(scheduler)
    assert [(c.request.request_id, c.start, c.num_tokens) for c in step2.chunks] == [
        ("first", 12, 1), ("other", 12, 1), ("twin", 8, 4),  # 2 blocks reused, as a later arrival would
    ]
    assert twin.metrics.num_cached_tokens == 8
    assert scheduler.block_manager.block_table("twin")[:2] == first_blocks[:2]


def test_twins_do_not_wait_with_prefix_caching_off():
    scheduler = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=100)
    for request_id in ("first", "twin"):
        scheduler.add(make_request(request_id, 12, max_tokens=1))
    assert [c.request.request_id for c in run_step(scheduler).chunks] == ["first", "twin"]


def test_a_waiting_twin_is_admitted_once_a_chunked_producer_passes_the_shared_blocks():
    # the producer's 40-token prompt is chunked 16 tokens a step; the twin shares its first 8 blocks of 4
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=16)
    producer = make_request("producer", 40, max_tokens=1)
    twin = Request("twin", ProcessedPrompt(producer.prompt.token_ids[:32].tolist() + [99] * 8, [], []),
                   SamplingParams(max_tokens=1), max_model_len=4096)
    scheduler.add(producer)
    scheduler.add(twin)
    starts = []
    while twin.metrics.first_scheduled_time is None:
        run_step(scheduler)
        starts.append(producer.num_computed_tokens)
    assert starts == [16, 32, 40]  # admitted in the step after the producer computed the 8 shared blocks
    assert twin.metrics.num_cached_tokens == 32  # the 8 shared blocks came from the cache


def test_finish_releases_waiting_and_running_requests():
    scheduler = Scheduler(BlockManager(8, 4), max_num_seqs=1, max_num_batched_tokens=100)
    running, waiting = make_request("running", 5), make_request("waiting", 5)
    scheduler.add(running)
    scheduler.add(waiting)
    run_step(scheduler)
    scheduler.finish(waiting, FinishReason.ABORT)
    scheduler.finish(running, FinishReason.ABORT)
    assert not scheduler.has_unfinished() and scheduler.block_manager.num_free_blocks == 8
    assert running.finish_reason is FinishReason.ABORT


def image_request(request_id, images_at, num_tokens=40):
    """A request whose images (4 tokens each, grid 1x4x4) start at the token indices `images_at`."""
    probes = [ImageProbe(source=b"", grid_thw=(1, 4, 4), num_tokens=4, content_hash=f"{request_id}-{start}")
              for start in images_at]
    prompt = ProcessedPrompt([1] * num_tokens, probes, [(start, 4) for start in images_at])
    return Request(request_id, prompt, SamplingParams(max_tokens=4), max_model_len=4096)


def test_upcoming_images_are_the_uncomputed_images_of_running_then_waiting_requests():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=24, policy="shortest_prompt_first")
    first = image_request("first", [2, 30])  # 40 tokens: prefilled over two steps
    scheduler.add(first)
    scheduler.add(image_request("later", [0], num_tokens=50))
    scheduler.add(image_request("sooner", [10, 12], num_tokens=45))  # shorter: admitted before "later"

    def upcoming():
        return [image.content_hash for image in scheduler.upcoming_images()]

    assert upcoming() == ["first-2", "first-30", "sooner-10", "sooner-12", "later-0"]  # the queue's policy order
    run_step(scheduler)  # "first" computes tokens 0-23: its first image is done
    assert upcoming() == ["first-30", "sooner-10", "sooner-12", "later-0"]
    run_step(scheduler)  # "first" ends its prompt (24-39); "sooner" computes 0-7, before its images
    assert upcoming() == ["sooner-10", "sooner-12", "later-0"]
    run_step(scheduler)  # "first" decodes; "sooner" computes 8-30: both its images
    assert upcoming() == ["later-0"]
