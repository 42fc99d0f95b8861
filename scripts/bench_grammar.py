#!/usr/bin/env python
"""Per-record grammar compile time: xgrammar's flat enum against our radix-tree enum.

Catalogue extraction compiles one grammar per record (`category` is an enum of
that record's candidates), so compile time is paid once per request. For each
record of the catalogue this compiles, with the default model's tokenizer:

- flat: the grammar xgrammar writes for the restricted schema (one
  alternative per candidate, each a full category path);
- ours: the same language with the enum factored into a radix tree
  (`vlm_catalog.structured.literal_trie`), as the engine compiles it.

It prints the median and mean milliseconds per record and the EBNF sizes,
and checks that both grammars accept every candidate's answer.

Then the per-step cost: the token bitmask of a batch of `--fill-batch` requests
(each record's grammar, advanced to a different point of its answer), filled
row by row (`GrammarState.fill_bitmask`) and in parallel threads
(`BitmaskFiller`, what the engine does), with the rows checked equal. Mask width
is the tokenizer's ids (`GrammarVocabulary.mask_size`), whatever the logits' width
(`--vocab-size`, default the model's padded vocabulary).

And the grammars' host work of whole decode steps as answers progress (`--walk-batch`): each
request walks its own answer token by token; a step fills the batch's masks (`BitmaskFiller`,
forced spans planned as they come, as in the engine) and then advances every grammar over its
next token (`GrammarState.accept`). Fixed positions (above) never plan a span twice.

And the same steps as bench_gpu.py's random-weight model takes them (`--random-steps`): each
request samples a token uniformly among those its mask allows, until its grammar finishes,
so most steps are spent inside free-text strings rather than on forced spans.

    python scripts/bench_grammar.py [--dataset data/sample_catalogue] [--records 64] [--fill-batch 256]
        [--walk-batch 256] [--random-steps 150] [--vocab-size 151936] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import xgrammar as xgr
from transformers import AutoTokenizer
from xgrammar.testing import _is_grammar_accept_string  # whole-string match against a grammar

from vlm_catalog.argument_types import positive_int
from vlm_catalog.data.format import CatalogueError
from vlm_catalog.data.loader import load_catalogue
from vlm_catalog.model.config import ModelConfig
from vlm_catalog.paths import DEFAULT_MODEL_DIR, SAMPLE_CATALOGUE_DIR
from vlm_catalog.structured import (
    BitmaskFiller,
    GrammarCompilerService,
    GrammarError,
    GrammarSpec,
    GrammarState,
    allocate_bitmask,
    catalogue_schema,
)
from vlm_catalog.structured.bitmask import row_token_ids
from vlm_catalog.structured.compiler import json_schema_grammar
from vlm_catalog.structured.vocabulary import GrammarVocabulary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--dataset", type=Path, default=SAMPLE_CATALOGUE_DIR)
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--fill-batch", type=int, default=256, help="requests per bitmask fill (0: skip)")
    parser.add_argument("--fill-repeats", type=int, default=20)
    parser.add_argument("--fill-threads", default="auto", help="BitmaskFiller threads (auto: half the CPUs)")
    parser.add_argument("--walk-batch", type=int, default=256, help="requests walking their answers (0: skip)")
    parser.add_argument("--random-steps", type=int, default=0,
                        help="steps of --walk-batch requests sampling uniformly among allowed tokens (0: skip)")
    parser.add_argument("--vocab-size", type=positive_int, default=None,
                        help="the logits' width (default: the model's); e.g. 151936, bench_gpu.py's random 30B-shape "
                             "model over the shipped tokenizer")
    parser.add_argument("--json", dest="json_out", type=Path)
    args = parser.parse_args(argv)

    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    stop_ids = [tokenizer.convert_tokens_to_ids(token) for token in ("<|im_end|>", "<|endoftext|>")]
    try:  # a --vocab-size below the tokenizer's ids, no such --dataset: one line, before any timing
        vocabulary = GrammarVocabulary(tokenizer, args.vocab_size or ModelConfig.from_pretrained(args.model).text.vocab_size,
                                       stop_ids)
        records = list(load_catalogue(args.dataset))[: args.records]
    except (GrammarError, CatalogueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    compiler = xgr.GrammarCompiler(vocabulary.info, max_threads=1, cache_enabled=False)

    seconds: dict[str, list[float]] = {"flat": [], "ours": []}
    sizes: dict[str, list[int]] = {"flat": [], "ours": []}
    accepted = 0
    for record in records:
        schema_text = json.dumps(catalogue_schema(record.candidate_categories).json_schema)
        grammars = {
            "flat": lambda text=schema_text: xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=(",", ":")),
            "ours": lambda text=schema_text: json_schema_grammar(text),
        }
        built = {}
        for name, build in grammars.items():
            start = time.perf_counter()
            built[name] = build()
            compiler.compile_grammar(built[name])
            seconds[name].append(time.perf_counter() - start)
            sizes[name].append(len(str(built[name])))
        answers = [
            json.dumps({"category": c, "brand": "Acme", "is_secondhand": False}, separators=(",", ":"))
            for c in record.candidate_categories
        ]
        accepted += all(_is_grammar_accept_string(built[name], answer) for name in built for answer in answers)

    report = {
        "records": len(records),
        "ms_per_record": {name: {"median": 1e3 * statistics.median(v), "mean": 1e3 * statistics.fmean(v)}
                          for name, v in seconds.items()},
        "ebnf_chars_mean": {name: statistics.fmean(v) for name, v in sizes.items()},
        "records_where_both_accept_every_candidate": accepted,
    }
    report["speedup_median"] = report["ms_per_record"]["flat"]["median"] / report["ms_per_record"]["ours"]["median"]
    fill_equal = True
    if args.fill_batch > 0:
        threads = args.fill_threads if args.fill_threads == "auto" else int(args.fill_threads)
        report["bitmask_fill"] = measure_fill(tokenizer, vocabulary.vocab_size, stop_ids, records,
                                              args.fill_batch, args.fill_repeats, threads)
        fill_equal = report["bitmask_fill"]["rows_equal"]
    if args.walk_batch > 0:
        threads = args.fill_threads if args.fill_threads == "auto" else int(args.fill_threads)
        report["decode_steps"] = measure_walk(tokenizer, vocabulary.vocab_size, stop_ids, records, args.walk_batch,
                                              threads)
    if args.random_steps > 0:
        threads = args.fill_threads if args.fill_threads == "auto" else int(args.fill_threads)
        report["random_steps"] = measure_random_steps(tokenizer, vocabulary.vocab_size, stop_ids, records,
                                                      args.walk_batch, args.random_steps, threads)
    for name in seconds:
        timing = report["ms_per_record"][name]
        print(f"{name:<5} median {timing['median']:6.2f} ms  mean {timing['mean']:6.2f} ms  "
              f"EBNF {report['ebnf_chars_mean'][name]:8.0f} chars")
    print(f"speedup (median): {report['speedup_median']:.2f}x; both accept every candidate in "
          f"{accepted}/{len(records)} records")
    if "bitmask_fill" in report:
        fill = report["bitmask_fill"]
        print(f"bitmask fill, {fill['batch']} requests, logits of {fill['vocab_size']} ids: row by row "
              f"{fill['ms_row_by_row']:.2f} ms, BitmaskFiller {fill['ms_batched']:.2f} ms "
              f"({fill['speedup']:.2f}x; {fill['threads']} threads, {fill['cpu_count']} CPUs); "
              f"rows equal: {fill['rows_equal']}")
    if "decode_steps" in report:
        walk = report["decode_steps"]
        print(f"decode steps, {walk['batch']} requests walking their answers ({walk['steps']} steps): "
              f"fill {walk['ms_fill_median']:.2f} ms, advance {walk['ms_advance_median']:.2f} ms per step (median)")
    if "random_steps" in report:
        walk = report["random_steps"]
        print(f"random-model steps, {walk['batch']} requests ({walk['steps']} steps): "
              f"fill {walk['ms_fill_median']:.2f} ms, advance {walk['ms_advance_median']:.2f} ms per step (median)")
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if accepted == len(records) and fill_equal else 1


def catalogue_answers(tokenizer, stop_ids: list[int], records, batch: int) -> list[list[int]]:
    """A token answer per request (a candidate of its record, a brand, the flag), ending in a stop token."""
    answers = []
    for i in range(batch):
        record = records[i % len(records)]
        answer = json.dumps({"category": record.candidate_categories[i % len(record.candidate_categories)],
                             "brand": "Acme", "is_secondhand": False}, separators=(",", ":"))
        answers.append(tokenizer.encode(answer, add_special_tokens=False) + [stop_ids[0]])
    return answers


def compiled_grammars(tokenizer, vocab_size: int, stop_ids: list[int], records) -> list:
    with GrammarCompilerService(tokenizer, vocab_size, stop_ids) as service:
        return [service.compile(GrammarSpec.from_request(json_schema=catalogue_schema(r.candidate_categories)))
                for r in records]


def measure_walk(tokenizer, vocab_size: int, stop_ids: list[int], records, batch: int,
                 threads: int | str = "auto") -> dict:
    """Median ms per decode step of the grammars' host work while `batch` requests walk their
    answers in step (module doc)."""
    compiled = compiled_grammars(tokenizer, vocab_size, stop_ids, records)
    answers = catalogue_answers(tokenizer, stop_ids, records, batch)
    states = [GrammarState(compiled[i % len(compiled)]) for i in range(batch)]
    steps = min(len(answer) for answer in answers) - 1  # all still inside their answers: none finishes
    report = time_grammar_steps(states, threads, steps, lambda step, alive, bitmask: [a[step] for a in answers])
    return {**report, "vocab_size": vocab_size}


def measure_random_steps(tokenizer, vocab_size: int, stop_ids: list[int], records, batch: int, steps: int,
                         threads: int | str = "auto", seed: int = 0) -> dict:
    """Median ms per step of the grammars' host work while `batch` requests sample uniformly among
    their allowed tokens (seeded), for up to `steps` steps or until every grammar finishes."""
    import random

    compiled = compiled_grammars(tokenizer, vocab_size, stop_ids, records)
    states = [GrammarState(compiled[i % len(compiled)]) for i in range(batch)]
    rng = random.Random(seed)

    def sampled(step, alive, bitmask):
        return [rng.choice(row_token_ids(bitmask[row], state.mask_size)) for row, state in enumerate(alive)]

    return {**time_grammar_steps(states, threads, steps, sampled), "vocab_size": vocab_size}


def time_grammar_steps(states: list[GrammarState], threads: int | str, steps: int, next_tokens) -> dict:
    """Median ms per step of the grammars' host work, as the engine does it: the masks of the
    states not yet finished filled in one `BitmaskFiller` call (forced spans planned as they
    come), then each advanced over its token from `next_tokens(step, alive, bitmask)` and asked
    `is_finished`; up to `steps` steps or until every state finishes."""
    filler, bitmask = BitmaskFiller(threads), allocate_bitmask(len(states), states[0].mask_size)
    fill, advance = [], []
    for step in range(steps):
        alive = [state for state in states if not state.is_finished()]
        if not alive:
            break
        start = time.perf_counter()
        filler.fill(alive, list(range(len(alive))), bitmask, force_canonical=True)
        middle = time.perf_counter()
        tokens = next_tokens(step, alive, bitmask)
        chosen = time.perf_counter()
        for state, token in zip(alive, tokens):
            state.accept([token])
            state.is_finished()
        fill.append(middle - start)
        advance.append(time.perf_counter() - chosen)
    return {"batch": len(states), "steps": len(fill), "threads": threads,
            "ms_fill_median": 1e3 * statistics.median(fill), "ms_advance_median": 1e3 * statistics.median(advance)}


def measure_fill(
    tokenizer, vocab_size: int, stop_ids: list[int], records, batch: int, repeats: int, threads: int | str = "auto"
) -> dict:
    """Median ms to fill one step's bitmask for `batch` requests, row by row and batched."""
    import os

    compiled = compiled_grammars(tokenizer, vocab_size, stop_ids, records)
    states = []
    for i, answer in enumerate(catalogue_answers(tokenizer, stop_ids, records, batch)):
        tokens = answer[:-1]  # without the stop token
        state = GrammarState(compiled[i % len(compiled)])
        state.accept(tokens[: i % len(tokens)])  # each request at another point of its answer
        states.append(state)
    rows = list(range(batch))
    filler = BitmaskFiller(threads)
    one_by_one, batched = (allocate_bitmask(batch, states[0].mask_size) for _ in range(2))
    timings: dict[str, list[float]] = {"row_by_row": [], "batched": []}
    for _ in range(repeats):
        start = time.perf_counter()
        for state, row in zip(states, rows):
            state.fill_bitmask(one_by_one, row, force_canonical=True)
        timings["row_by_row"].append(time.perf_counter() - start)
        start = time.perf_counter()
        filler.fill(states, rows, batched, force_canonical=True)
        timings["batched"].append(time.perf_counter() - start)
    row_ms, batched_ms = (1e3 * statistics.median(timings[k]) for k in ("row_by_row", "batched"))
    return {"batch": batch, "vocab_size": vocab_size, "cpu_count": os.cpu_count(), "threads": threads,
            "ms_row_by_row": row_ms, "ms_batched": batched_ms, "speedup": row_ms / batched_ms,
            "rows_equal": bool((one_by_one == batched).all())}


if __name__ == "__main__":
    sys.exit(main())
