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

    python scripts/bench_grammar.py [--dataset data/sample_catalogue] [--records 64] [--json out.json]
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

from vlm_catalog.data.loader import load_catalogue
from vlm_catalog.model.config import ModelConfig
from vlm_catalog.paths import DEFAULT_MODEL_DIR, SAMPLE_CATALOGUE_DIR
from vlm_catalog.structured import catalogue_schema
from vlm_catalog.structured.compiler import json_schema_grammar
from vlm_catalog.structured.vocabulary import GrammarVocabulary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--dataset", type=Path, default=SAMPLE_CATALOGUE_DIR)
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--json", dest="json_out", type=Path)
    args = parser.parse_args(argv)

    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    stop_ids = [tokenizer.convert_tokens_to_ids(token) for token in ("<|im_end|>", "<|endoftext|>")]
    vocabulary = GrammarVocabulary(tokenizer, ModelConfig.from_pretrained(args.model).text.vocab_size, stop_ids)
    compiler = xgr.GrammarCompiler(vocabulary.info, max_threads=1, cache_enabled=False)
    records = list(load_catalogue(args.dataset))[: args.records]

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
    for name in seconds:
        timing = report["ms_per_record"][name]
        print(f"{name:<5} median {timing['median']:6.2f} ms  mean {timing['mean']:6.2f} ms  "
              f"EBNF {report['ebnf_chars_mean'][name]:8.0f} chars")
    print(f"speedup (median): {report['speedup_median']:.2f}x; both accept every candidate in "
          f"{accepted}/{len(records)} records")
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if accepted == len(records) else 1


if __name__ == "__main__":
    sys.exit(main())
