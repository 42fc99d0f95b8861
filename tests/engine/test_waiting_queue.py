"""The waiting queue: policy order under adds, front-adds, removals and put-backs, checked
against sorting a plain list (what the scheduler did before), and a walk that stays lazy."""

import random

import pytest

from vlm_catalog.engine.request import Request
from vlm_catalog.engine.sampling_params import SamplingParams
from vlm_catalog.engine.waiting_queue import WaitingQueue
from vlm_catalog.preprocess.processor import ProcessedPrompt


def make_request(request_id: str, num_tokens: int) -> Request:
    return Request(request_id, ProcessedPrompt([1] * num_tokens, [], []), SamplingParams(max_tokens=4), max_model_len=4096)


def ids(requests) -> list[str]:
    return [request.request_id for request in requests]


def test_fcfs_keeps_arrival_order_and_the_last_request_put_in_front_comes_first():
    queue = WaitingQueue("fcfs")
    a, b, c, d = (make_request(name, 10) for name in "abcd")
    queue.add(a)
    queue.add(b)
    queue.add_front(c)  # preempted: ahead of every arrival
    queue.add_front(d)  # preempted after c (deque.appendleft semantics)
    assert ids(queue) == ["d", "c", "a", "b"]
    assert len(queue) == 4 and c in queue


def test_shortest_prompt_first_orders_by_tokens_left_then_arrival():
    queue = WaitingQueue("shortest_prompt_first")
    requests = [make_request("long", 30), make_request("short", 5), make_request("mid", 12), make_request("short2", 5)]
    for request in requests:
        queue.add(request)
    assert ids(queue) == ["short", "short2", "mid", "long"]
    request, key = queue.pop()
    assert request.request_id == "short" and request not in queue
    queue.put_back(request, key)  # not admitted: back in its place
    assert ids(queue) == ["short", "short2", "mid", "long"]
    with pytest.raises(ValueError, match="already waiting"):
        queue.add(requests[0])


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        WaitingQueue("lifo")


@pytest.mark.parametrize("policy", ["fcfs", "shortest_prompt_first"])
def test_random_operations_match_a_sorted_list(policy):
    """A reference that sorts the whole list by the same keys, over thousands of random operations
    (the heap is rebuilt many times on the way: most removals are from the middle)."""
    rng = random.Random(7)
    queue, reference = WaitingQueue(policy), []  # reference: [(key, request)]
    back, front = 0, 0
    for step in range(4000):
        action = rng.random()
        if action < 0.45 or not reference:
            request = make_request(f"r{step}", rng.randint(1, 50))
            if rng.random() < 0.2:
                front -= 1
                queue.add_front(request)
                sequence = front
            else:
                queue.add(request)
                sequence = back
                back += 1
            key = (sequence,) if policy == "fcfs" else (request.num_tokens, request.metrics.arrival_time, sequence)
            reference.append((key, request))
        elif action < 0.75:
            _, victim = reference.pop(rng.randrange(len(reference)))
            queue.remove(victim)
        else:
            reference.sort(key=lambda entry: entry[0])
            expected_key, expected = reference.pop(0)
            got, key = queue.pop()
            assert got is expected and key == expected_key
            if rng.random() < 0.5:  # skipped this step: put back
                queue.put_back(got, key)
                reference.append((key, got))
        if step % 97 == 0:
            assert ids(queue) == ids(request for _, request in sorted(reference, key=lambda entry: entry[0]))
    assert len(queue) == len(reference)
    assert len(queue._heap) <= 64 + 2 * len(queue) + 1  # forgotten entries do not pile up


def test_walking_the_front_does_not_walk_the_whole_queue():
    queue = WaitingQueue("shortest_prompt_first")
    for index in range(10_000):
        queue.add(make_request(f"r{index}", 1 + index % 997))
    looked_at = []
    is_live = queue._is_live
    queue._is_live = lambda entry: looked_at.append(entry) or is_live(entry)
    walked = iter(queue)
    first = [next(walked) for _ in range(5)]
    assert len(looked_at) == 5  # entries are looked at as the walk reaches them, not all 10,000
    assert [r.num_tokens for r in first] == [1] * 5  # the shortest, in arrival order
    assert ids(first) == ["r0", "r997", "r1994", "r2991", "r3988"]
