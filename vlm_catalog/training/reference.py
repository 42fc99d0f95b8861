"""Does the engine lose accuracy? The same weights and prompts through our engine and transformers.

Three ways to answer a held-out catalogue with one model directory, all
greedy, all with the mlperf prompt, scored by the benchmark's metric:

- engine, constrained: `LLM.extract` as users run it (per-record JSON schema);
- engine, free: `LLM.chat` with no schema (the model's own JSON);
- transformers, free: `Qwen3VLMoeForConditionalGeneration.generate` through
  transformers' own processor (`vlm_catalog.bench.baselines.TransformersPipeline`),
  the answer cut at the first <|im_end|>.

    python -m vlm_catalog.training.reference --model data/models/tiny-qwen3-vl-moe --catalogue DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vlm_catalog.evaluate.scoring import AccuracyReport, score

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


def transformers_texts(model_dir: Path, records: list, batch_size: int = 8) -> list[str]:
    from vlm_catalog.bench.baselines import TransformersPipeline
    from vlm_catalog.preprocess.prompt import build_mlperf_messages

    pipeline = TransformersPipeline(model_dir)
    end = pipeline.tokenizer.convert_tokens_to_ids("<|im_end|>")
    texts = []
    for first in range(0, len(records), batch_size):
        chunk = [build_mlperf_messages(record) for record in records[first : first + batch_size]]
        for tokens in pipeline.generate(chunk, MAX_NEW_TOKENS):
            tokens = tokens[: tokens.index(end)] if end in tokens else tokens
            texts.append(pipeline.tokenizer.decode(tokens))
    return texts


def compare(model_dir: Path, catalogue_dir: Path) -> dict[str, AccuracyReport]:
    from vlm_catalog.data.loader import load_catalogue

    catalogue = load_catalogue(catalogue_dir)
    records, labels = list(catalogue), catalogue.labels()
    runs = {
        "engine, constrained": engine_texts(model_dir, records, constrained=True),
        "engine, free": engine_texts(model_dir, records, constrained=False),
        "transformers, free": transformers_texts(model_dir, records),
    }
    return {name: score(list(enumerate(texts)), labels) for name, texts in runs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--catalogue", type=Path, required=True)
    parser.add_argument("--json", type=Path, default=None, help="write the three reports here")
    args = parser.parse_args(argv)
    reports = compare(args.model, args.catalogue)
    print(f"{'':<22}{'category hF1':>14}{'brand acc':>12}{'2nd-hand F1':>13}{'unparsable':>12}")
    for name, report in reports.items():
        print(f"{name:<22}{report.category_hf1:>14.4f}{report.brand_accuracy:>12.4f}"
              f"{report.is_secondhand_f1:>13.4f}{report.num_unparsable:>12d}")
    if args.json:
        args.json.write_text(json.dumps({name: r.to_dict() for name, r in reports.items()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
