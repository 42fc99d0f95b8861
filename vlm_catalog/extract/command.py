"""`vlm-catalog extract`: run the model over a catalogue and write predictions JSONL.

Each line is `{"id": <record id>, "response": <raw model text>}` (what
`vlm-catalog eval` reads), plus the parsed answer and per-request metrics.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from vlm_catalog.paths import DEFAULT_MODEL_DIR


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "extract", help="extract structured metadata for every record of a catalogue",
        description="Run catalogue extraction (per-record constrained JSON) and write predictions JSONL.",
    )
    add_extraction_arguments(parser)
    parser.add_argument("--dataset", type=Path, required=True, help="catalogue to read")
    parser.add_argument("--out", type=Path, required=True, help="predictions JSONL to write")
    parser.set_defaults(handler=run)


def add_extraction_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR, help="checkpoint directory")
    parser.add_argument("--split", default=None, help='splits to use, e.g. "test" or "train+test"')
    parser.add_argument("--limit", type=int, default=None, help="only the first N records")
    parser.add_argument("--schema", default="product_metadata", help="answer schema (a registered name)")
    parser.add_argument("--prompt-style", default="mlperf", choices=("mlperf", "concise"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=150)
    parser.add_argument("--no-prefix-caching", action="store_true", help="as the benchmark's rules require")
    parser.add_argument("--policy", default="fcfs", choices=("fcfs", "shortest_prompt_first"))


def extract_catalogue(args: argparse.Namespace, out: Path) -> dict:
    """Run extraction for `args`; write predictions to `out`; return a summary."""
    from schemas import resolve_schema
    from vlm_catalog import LLM, SamplingParams
    from vlm_catalog.data.loader import load_catalogue

    schema = resolve_schema(args.schema).model
    catalogue = load_catalogue(args.dataset, split=args.split)
    records = [catalogue[i] for i in range(len(catalogue) if args.limit is None else min(args.limit, len(catalogue)))]
    llm = LLM(
        args.model, device=args.device, dtype=args.dtype,
        enable_prefix_caching=not args.no_prefix_caching, scheduling_policy=args.policy,
    )
    start = time.perf_counter()
    results = llm.extract(
        records, schema=schema, prompt_style=args.prompt_style,
        sampling_params=SamplingParams(max_tokens=args.max_tokens), use_tqdm=sys.stderr.isatty(),
    )
    seconds = time.perf_counter() - start
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as handle:
        for result in results:
            handle.write(json.dumps({
                "id": result.record_id,
                "response": result.text,
                "parsed": result.metadata.model_dump(mode="json") if result.metadata else None,
                "finish_reason": result.finish_reason,
                "error": result.error,
                "metrics": result.metrics,
            }) + "\n")
    stats = llm.engine.stats
    llm.engine.close()
    return {
        "records": len(records),
        "seconds": seconds,
        "records_per_second": len(records) / seconds if seconds else 0.0,
        "valid_answers": sum(result.ok for result in results),
        "failed": sum(result.finish_reason == "error" for result in results),
        "model_steps": stats.num_sampled_tokens,
        "jump_forward_tokens": stats.num_jump_forward_tokens,
        "prompt_tokens_computed": stats.num_prompt_tokens_computed,
    }


def run(args: argparse.Namespace) -> int:
    from schemas import SchemaError
    from vlm_catalog.data.format import CatalogueError
    from vlm_catalog.engine.config import EngineConfigError
    from vlm_catalog.model.config import ModelConfigError
    from vlm_catalog.model.loader import CheckpointError

    try:
        summary = extract_catalogue(args, args.out)
    except (CatalogueError, CheckpointError, ModelConfigError, EngineConfigError, SchemaError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"extracted {summary['records']} records in {summary['seconds']:.1f} s "
        f"({summary['records_per_second']:.2f} records/s): {summary['valid_answers']} valid answers, "
        f"{summary['failed']} failed; wrote {args.out}"
    )
    return 0
