"""Does the engine lose accuracy? The same weights and prompts through our engine and transformers.

Four ways to answer a held-out catalogue with one model directory, all
greedy, all with the mlperf prompt, scored by the benchmark's metric:

- engine, constrained: `LLM.extract` as users run it (per-record JSON schema);
- engine, free: `LLM.chat` with no schema (the model's own JSON);
- transformers, free: `Qwen3VLMoeForConditionalGeneration.generate` through
  transformers' own processor (`vlm_catalog.bench.baselines.TransformersPipeline`),
  the answer cut at the first stop token;
- transformers, constrained: the same, with each record's grammar (the schema
  `LLM.extract` would use, compiled by our `GrammarCompilerService`) applied
  by xgrammar's own transformers logits processor.

    python -m vlm_catalog.training.reference --model data/models/tiny-qwen3-vl-moe --catalogue DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vlm_catalog.evaluate.scoring import AccuracyReport, score
from vlm_catalog.report_file import refuse_report_path, report_written
from vlm_catalog.training.checkpoint import checkpoint_problem

MAX_NEW_TOKENS = 150


def engine_texts(model_dir: Path, records: list, constrained: bool) -> list[str]:
    from vlm_catalog import LLM, SamplingParams
    from vlm_catalog.preprocess.prompt import build_mlperf_messages

    llm = LLM(model_dir)
    try:
        if constrained:
            return [result.text for result in llm.extract(records)]
        params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
        outputs = llm.chat([build_mlperf_messages(record) for record in records], params)
        return [output.text for output in outputs]
    finally:
        llm.engine.close()


def transformers_texts(model_dir: Path, records: list, constrained: bool, batch_size: int = 8) -> list[str]:
    from vlm_catalog.bench.baselines import TransformersPipeline
    from vlm_catalog.engine.llm_engine import eos_token_ids
    from vlm_catalog.preprocess.prompt import build_mlperf_messages

    pipeline = TransformersPipeline(model_dir)
    stops = eos_token_ids(model_dir, pipeline.tokenizer)
    grammars = RecordGrammars(pipeline, stops) if constrained else None
    texts = []
    for first in range(0, len(records), batch_size):
        chunk = records[first : first + batch_size]
        processors = [grammars.logits_processor(chunk)] if grammars else None
        for tokens in pipeline.generate([build_mlperf_messages(r) for r in chunk], MAX_NEW_TOKENS, processors):
            end = next((i for i, token in enumerate(tokens) if token in stops), len(tokens))
            texts.append(pipeline.tokenizer.decode(tokens[:end]))
    return texts


class RecordGrammars:
    """Each record's `LLM.extract` grammar as an xgrammar logits processor for transformers."""

    def __init__(self, pipeline, stop_token_ids) -> None:
        from vlm_catalog.structured import GrammarCompilerService

        self.tokenizer = pipeline.tokenizer
        self.service = GrammarCompilerService(
            self.tokenizer, vocab_size=pipeline.model.config.text_config.vocab_size,
            stop_token_ids=sorted(stop_token_ids),
        )

    def logits_processor(self, records: list):
        import xgrammar.contrib.hf

        from vlm_catalog.structured.catalogue import record_schema, token_counter
        from vlm_catalog.structured.spec import GrammarSpec

        count = token_counter(self.tokenizer)

        compiled = []
        for record in records:
            schema, _, _ = record_schema(record.candidate_categories, MAX_NEW_TOKENS, count)
            compiled.append(self.service.compile(GrammarSpec.from_request(json_schema=schema)).grammar)
        return xgrammar.contrib.hf.LogitsProcessor(compiled)  # one use: one generate() call


def compare(model_dir: Path, catalogue) -> dict[str, AccuracyReport]:
    """The four ways' accuracy on `catalogue` (a loaded `Catalogue`)."""
    records, labels = list(catalogue), catalogue.labels()
    runs = {
        "engine, constrained": engine_texts(model_dir, records, constrained=True),
        "engine, free": engine_texts(model_dir, records, constrained=False),
        "transformers, free": transformers_texts(model_dir, records, constrained=False),
        "transformers, constrained": transformers_texts(model_dir, records, constrained=True),
    }
    return {name: score(list(enumerate(texts)), labels) for name, texts in runs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--catalogue", type=Path, required=True)
    parser.add_argument("--json", type=Path, default=None, help="write the four reports here")
    args = parser.parse_args(argv)
    if refuse_report_path(args.json):  # before the scoring, not after it
        return 2
    from vlm_catalog.data.format import CatalogueError
    from vlm_catalog.data.loader import load_catalogue

    problem = checkpoint_problem(args.model, "--model")
    if problem is None:
        try:
            catalogue = load_catalogue(args.catalogue)
        except CatalogueError as exc:
            problem = str(exc)
    if problem:  # before any model loads
        print(f"error: {problem}", file=sys.stderr)
        return 2
    reports = compare(args.model, catalogue)
    print(f"{'':<27}{'category hF1':>14}{'brand acc':>12}{'2nd-hand F1':>13}{'unparsable':>12}")
    for name, report in reports.items():
        print(f"{name:<27}{report.category_hf1:>14.4f}{report.brand_accuracy:>12.4f}"
              f"{report.is_secondhand_f1:>13.4f}{report.num_unparsable:>12d}")
    report = json.dumps({name: r.to_dict() for name, r in reports.items()}, indent=2) + "\n"
    return 1 if args.json and not report_written(args.json, report) else 0


if __name__ == "__main__":
    sys.exit(main())
