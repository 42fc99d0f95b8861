"""`GrammarCompilerService`: compiles grammars in a thread pool, off the step loop.

The engine submits a request's `GrammarSpec` when the request arrives and
schedules the request once the future is done, so no decode step ever waits on
a compilation. Compiled grammars are kept in an LRU cache keyed by the spec
(bounded by entry count); an entry holds the *future*, so concurrent submits of
the same spec share one compilation. Failed compilations are not cached: the
future raises `GrammarError` with xgrammar's message, and the service goes on
serving other specs.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import xgrammar as xgr

from vlm_catalog.structured.errors import GrammarError
from vlm_catalog.structured.literal_trie import (
    factor_literal_alternations,
    literal_alternation_rules,
)
from vlm_catalog.structured.spec import GrammarSpec
from vlm_catalog.structured.vocabulary import GrammarVocabulary

# Compact JSON: the answers are short, and every whitespace token is a wasted step.
JSON_SEPARATORS = (",", ":")

# xgrammar prefixes its C++ errors with "[12:34:56] /project/cpp/file.cc:83: ".
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled grammar plus the vocabulary every `GrammarState` built from it needs."""

    spec: GrammarSpec
    grammar: xgr.CompiledGrammar
    vocabulary: GrammarVocabulary
    compile_seconds: float

    @property
    def memory_bytes(self) -> int:
        return int(self.grammar.memory_size_bytes)


@dataclass(frozen=True)
class CompilerStats:
    """A snapshot of the service's counters."""

    hits: int  # submits answered from the cache (including in-flight compilations)
    misses: int  # submits that started a compilation
    compilations: int  # compilations that succeeded
    failures: int  # compilations that raised GrammarError
    evictions: int  # entries dropped to keep the cache within cache_size
    cached: int  # entries in the cache now
    compile_seconds: float  # total time spent compiling (successes and failures)


class CompileClock:
    """When a submitted grammar began compiling (`time.perf_counter()`), None while it waits for
    a thread: a request's compile timeout counts from there, not from the time it spent queued
    behind others' compiles (one schema of thousands of optional properties takes a minute)."""

    started: float | None = None


def compile_started(future: Future, otherwise: float) -> float | None:
    """When the compile behind `future` began (None while queued), or `otherwise` for a future
    this service did not make."""
    clock = getattr(future, "compile_clock", None)
    return otherwise if clock is None else clock.started


class GrammarCompilerService:
    """Compile `GrammarSpec`s for one tokenizer in background threads; LRU-cache the results.

    `vocab_size` is the model's logits width (padding included), `stop_token_ids`
    the tokens that end an answer (`<|im_end|>`, `<|endoftext|>`).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_workers: int = 1,
        cache_size: int = 256,
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.vocabulary = GrammarVocabulary(tokenizer, vocab_size, stop_token_ids)
        # xgrammar's own cache is unbounded by default; ours is the only one.
        self._compiler = xgr.GrammarCompiler(
            self.vocabulary.info, max_threads=max_workers, cache_enabled=False
        )
        self.workers = max_workers  # threads compiling, each with xgrammar's own threads as many
        self._executor = ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="grammar-compile"
        )
        self._cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self._hits = self._misses = self._compilations = self._failures = self._evictions = 0
        self._compile_seconds = 0.0

    def submit(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """A future of the compiled grammar; it raises `GrammarError` if compilation fails."""
        if not isinstance(spec, GrammarSpec):
            raise TypeError(f"submit() takes a GrammarSpec, got {type(spec).__name__}")
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compiler service is closed")
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                self._hits += 1
                return future
            self._misses += 1
            clock = CompileClock()
            future = self._executor.submit(self._compile, spec, clock)
            future.compile_clock = clock  # type: ignore[attr-defined]  # read by `compile_started`
            self._cache[spec] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
                self._evictions += 1
        future.add_done_callback(partial(self._forget_if_failed, spec))
        return future

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Blocking convenience: `submit(spec).result()`."""
        return self.submit(spec).result()

    def stats(self) -> CompilerStats:
        with self._lock:
            return CompilerStats(
                hits=self._hits,
                misses=self._misses,
                compilations=self._compilations,
                failures=self._failures,
                evictions=self._evictions,
                cached=len(self._cache),
                compile_seconds=self._compile_seconds,
            )

    def close(self) -> None:
        """Stop the workers; queued compilations are cancelled, running ones finish."""
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> GrammarCompilerService:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- worker side ----------------------------------------------------------------------

    def _compile(self, spec: GrammarSpec, clock: CompileClock) -> CompiledGrammar:
        start = clock.started = time.perf_counter()
        try:
            grammar = self._compile_with_xgrammar(spec)
        except Exception as exc:  # anything xgrammar raises is this request's problem
            elapsed = time.perf_counter() - start
            with self._lock:
                self._failures += 1
                self._compile_seconds += elapsed
            message = f"cannot compile {spec.describe()}: {_xgrammar_message(exc)}"
            raise GrammarError(message) from exc
        elapsed = time.perf_counter() - start
        with self._lock:
            self._compilations += 1
            self._compile_seconds += elapsed
        return CompiledGrammar(
            spec=spec, grammar=grammar, vocabulary=self.vocabulary, compile_seconds=elapsed
        )

    def _compile_with_xgrammar(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.json_schema is not None:
            return self._compiler.compile_grammar(json_schema_grammar(spec.json_schema))
        if spec.regex is not None:
            return self._compiler.compile_regex(spec.regex)
        return self._compiler.compile_grammar(choice_ebnf(spec.choice or ()))

    def _forget_if_failed(self, spec: GrammarSpec, future: Future[CompiledGrammar]) -> None:
        if not future.cancelled() and future.exception() is None:
            return
        with self._lock:
            if self._cache.get(spec) is future:
                del self._cache[spec]


# xgrammar 0.2.x writes length-bounded JSON strings (minLength/maxLength) with the
# character class below, which lets raw control characters U+0000-U+001F into a
# string; JSON forbids them, so pydantic rejects such answers. Its unbounded
# string rule already excludes them; we give bounded strings the same class.
_LOOSE_STRING_CHARACTER = r'[^\"\\\r\n]'
_JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\\r\n]'


# and writes a \u escape as any four hex digits, so a lone surrogate (\ud800) ends a string
# that pydantic refuses ("unexpected end of hex escape"); we allow a surrogate only as a pair.
_HEX = "[A-Fa-f0-9]"
_ANY_UNICODE_ESCAPE = f'("u" {_HEX} {_HEX} {_HEX} {_HEX})'
_UNICODE_ESCAPE = (f'("u" (([0-9A-Ca-cE-Fe-f] {_HEX} {_HEX} {_HEX}) | ([Dd] [0-7] {_HEX} {_HEX})'
                   f' | ([Dd] [89ABab] {_HEX} {_HEX} "\\\\u" [Dd] [C-Fc-f] {_HEX} {_HEX})))')


def json_schema_grammar(schema_text: str) -> xgr.Grammar:
    """Compact-JSON grammar for a schema, with control characters and lone surrogates kept out
    of every string and enums written as radix trees (see `literal_trie`)."""
    grammar = xgr.Grammar.from_json_schema(schema_text, any_whitespace=False, separators=JSON_SEPARATORS)
    ebnf = str(grammar).replace(_LOOSE_STRING_CHARACTER, _JSON_STRING_CHARACTER)
    ebnf = ebnf.replace(_ANY_UNICODE_ESCAPE, _UNICODE_ESCAPE)
    try:
        return xgr.Grammar.from_ebnf(factor_literal_alternations(ebnf))
    except RuntimeError:  # a literal the EBNF parser reads differently: keep the flat enum
        return xgr.Grammar.from_ebnf(ebnf)


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar matching exactly one of `choices`, shared prefixes written once."""
    if not choices:
        raise GrammarError("choice is empty: give at least one string")
    return "\n".join(literal_alternation_rules("root", choices))


def _xgrammar_message(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    return _XGRAMMAR_LOG_PREFIX.sub("", text)
