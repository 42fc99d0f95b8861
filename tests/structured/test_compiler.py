"""GrammarCompilerService: cache, shared in-flight compilations, bounded LRU, failures."""

from __future__ import annotations

import threading

import pytest

from schemas import ProductMetadata
from vlm_catalog.structured import GrammarCompilerService, GrammarError, GrammarSpec, GrammarState

METADATA = GrammarSpec.from_request(json_schema=ProductMetadata)


def regex_spec(n: int) -> GrammarSpec:
    return GrammarSpec.from_request(regex=f"item-{n}-[a-z]+")


def test_same_spec_hits_the_cache(make_service):
    service = make_service()
    first = service.submit(METADATA).result()
    again = service.submit(GrammarSpec.from_request(json_schema="product_metadata")).result()
    assert again is first
    stats = service.stats()
    assert (stats.hits, stats.misses, stats.compilations) == (1, 1, 1)
    assert stats.compile_seconds > 0 and first.compile_seconds > 0
    assert first.memory_bytes > 0


def test_json_is_compiled_compact(service, tokenizer):
    state = GrammarState(service.compile(METADATA))
    # Forced: '{"category":' (the boundary '"' is the model's choice).
    assert tokenizer.decode(state.forced_tokens()) == '{"category":'
    state.accept(tokenizer.encode('{"category":"Toys","brand":"X"', add_special_tokens=False))
    with pytest.raises(GrammarError, match="not allowed"):
        state.accept(tokenizer.encode(", ", add_special_tokens=False))


def test_concurrent_identical_submits_compile_once(make_service):
    service = make_service(max_workers=1)
    # Occupy the only worker so the identical submits below find their spec in flight.
    many_options = [f"option {i} of many" for i in range(4000)]
    slow = service.submit(GrammarSpec.from_request(choice=many_options))
    target = regex_spec(0)
    barrier = threading.Barrier(8)
    futures = []

    def submit():
        barrier.wait()
        futures.append(service.submit(target))

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not futures[0].done(), "the target should still be queued behind the slow compilation"
    assert all(future is futures[0] for future in futures)
    futures[0].result()
    slow.result()
    stats = service.stats()
    assert (stats.misses, stats.hits, stats.compilations) == (2, 7, 2)


def test_several_workers_compile_distinct_grammars_each_right(make_service, tokenizer):
    """The engine compiles on several threads sharing one xgrammar compiler
    (`EngineConfig.grammar_compile_workers`): every grammar takes its own answer and no other."""
    service = make_service(max_workers=4)
    futures = {n: service.submit(regex_spec(n)) for n in range(12)}
    for n, future in futures.items():
        state = GrammarState(future.result())
        state.accept(tokenizer.encode(f"item-{n}-", add_special_tokens=False))
        other = GrammarState(future.result())
        with pytest.raises(GrammarError, match="not allowed"):
            other.accept(tokenizer.encode(f"item-{n + 20}-", add_special_tokens=False))
    assert service.stats().compilations == 12


def test_lru_eviction_bounds_the_cache(make_service):
    service = make_service(cache_size=2)
    a, b, c = regex_spec(1), regex_spec(2), regex_spec(3)
    first_a = service.compile(a)
    service.compile(b)
    service.compile(a)  # a becomes the most recently used
    service.compile(c)  # evicts b
    stats = service.stats()
    assert (stats.cached, stats.evictions, stats.misses, stats.hits) == (2, 1, 3, 1)
    assert service.compile(a) is first_a  # still cached
    service.compile(b)  # compiled again
    stats = service.stats()
    assert (stats.misses, stats.compilations, stats.cached) == (4, 4, 2)
    for n in range(4, 40):
        service.compile(regex_spec(n))
    assert service.stats().cached == 2


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            GrammarSpec.from_request(regex="(abc"),
            "cannot compile regex '\\(abc': .*parenthesis is not closed",
        ),
        (GrammarSpec.from_request(regex="[z-a]"), "lower bound is larger than upper bound"),
        (
            GrammarSpec.from_request(
                json_schema={"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}}
            ),
            "cannot compile json_schema .*minimum greater than maximum",
        ),
    ],
)
def test_failures_raise_grammar_error_and_service_keeps_working(make_service, spec, message):
    service = make_service()
    future = service.submit(spec)
    with pytest.raises(GrammarError, match=message) as caught:
        future.result()
    assert "/project/cpp" not in str(caught.value)  # xgrammar's log prefix is dropped
    assert service.stats().failures == 1
    assert service.stats().cached == 0  # failures are not cached
    state = GrammarState(service.compile(regex_spec(9)))
    assert not state.is_finished()
    with pytest.raises(GrammarError):
        service.submit(spec).result()  # tried again, fails again
    assert service.stats().misses == 3


def test_closed_service_refuses_work(make_service):
    service = make_service()
    service.close()
    with pytest.raises(RuntimeError, match="closed"):
        service.submit(METADATA)


def test_constructor_checks(tokenizer, stop_token_ids):
    with pytest.raises(GrammarError, match="smaller than the tokenizer"):
        GrammarCompilerService(tokenizer, 512, stop_token_ids)
    with pytest.raises(GrammarError, match="at least one stop token"):
        GrammarCompilerService(tokenizer, 1024, [])
    with pytest.raises(GrammarError, match=r"stop token ids \[1010\]"):
        GrammarCompilerService(tokenizer, 1024, [1010])
    with pytest.raises(ValueError, match="cache_size"):
        GrammarCompilerService(tokenizer, 1024, stop_token_ids, cache_size=0)


def test_bounded_json_strings_refuse_control_characters(service):
    """xgrammar 0.2.x lets raw U+0000-U+001F into minLength/maxLength strings; our grammar must not."""
    import xgrammar as xgr

    from vlm_catalog.structured import GrammarSpec

    schema = {"type": "object", "properties": {"b": {"type": "string", "maxLength": 8}}, "required": ["b"]}
    compiled = service.compile(GrammarSpec.from_request(json_schema=schema))
    matcher = xgr.GrammarMatcher(compiled.grammar)
    assert matcher.accept_string('{"b":"ab')
    assert not matcher.accept_string("\t") and not matcher.accept_string("\x01")
    assert matcher.accept_string('c"}')
