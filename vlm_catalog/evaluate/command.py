"""`vlm-catalog eval`: score a predictions file against a labelled catalogue."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from schemas import SchemaError, resolve_schema


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        description=(
            "Score model answers with the MLPerf VLM metric: category hierarchical F1, "
            "brand accuracy, is_secondhand F1, unparsable count and random baselines."
        ),
    )
    parser.add_argument(
        "--predictions", required=True, type=Path,
        help='JSONL of {"id": ..., "response": ...} or an MLPerf mlperf_log_accuracy.json',
    )
    parser.add_argument("--dataset", required=True, type=Path, help="labelled catalogue")
    parser.add_argument("--split", default=None, help='splits to use, e.g. "test" or "train+test"')
    parser.add_argument("--json", dest="json_out", type=Path, help="also write the numbers as JSON")
    parser.add_argument("--seed", type=int, default=12345, help="seed of the random draws")
    parser.add_argument(
        "--schema", default="product_metadata",
        help="answer schema to parse responses with (product_metadata is the benchmark's)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from vlm_catalog.batch.output import job_file
    from vlm_catalog.data.loader import CatalogueError, load_catalogue
    from vlm_catalog.evaluate.predictions import PredictionsError, read_predictions
    from vlm_catalog.evaluate.scoring import score
    from vlm_catalog.report_file import ReportFileError, check_report_path, write_report

    if args.seed < 0:  # numpy's own message named no option
        print(f"error: --seed must be 0 or more, got {args.seed}", file=sys.stderr)
        return 2
    try:
        if args.json_out:
            check_report_path(args.json_out, inputs=(args.predictions, job_file(args.predictions), args.dataset))
        answer_schema = resolve_schema(args.schema).model
        if answer_schema is None or not {"category", "brand", "is_secondhand"} <= set(
            answer_schema.model_fields
        ):
            raise SchemaError(f"schema {args.schema!r} lacks category/brand/is_secondhand")
        predictions = read_predictions(args.predictions)
        catalogue = load_catalogue(args.dataset, split=args.split)
        check_extract_job(args.predictions, args.split, len(catalogue), args.schema)
        responses = resolve_indices(predictions, catalogue)
        labels = catalogue.labels(scored=(index for index, _ in responses))  # only the scored must be whole
        report = score(responses, labels, seed=args.seed, answer_schema=answer_schema)
    except (PredictionsError, CatalogueError, SchemaError, ReportFileError, KeyError, ValueError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) else str(exc)
        print(f"error: {message}", file=sys.stderr)
        return 2
    print(report.format_table())
    for note in coverage_notes([index for index, _ in responses], len(catalogue)):
        print(f"note: {note}")
    if args.json_out:
        try:
            write_report(args.json_out, json.dumps(report.to_dict(), indent=2) + "\n")
        except ReportFileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.json_out}")
    return 0


def check_extract_job(predictions: Path, split: str | None, num_records: int, schema: str | None = None) -> None:
    """`PredictionsError` if the `vlm-catalog extract` job that wrote `predictions` (its
    `.job.json` beside it) selected other rows than this catalogue and `--split` hold, or answered
    in another schema than `schema`.

    A record id is a row index of the splits chosen, so predictions made with `--split test`
    and scored without it would each meet another record's labels, and score silently wrong;
    answers in another schema all failed to parse (product_details answers scored as
    product_metadata: every one "unparsable").
    """
    from vlm_catalog.batch.output import job_file
    from vlm_catalog.evaluate.predictions import PredictionsError

    job_path = job_file(Path(predictions))
    try:
        job = json.loads(job_path.read_bytes())
    except (OSError, ValueError):
        return  # not written by extract (a concatenation of shards, a LoadGen log, a pipe)
    if not isinstance(job, dict) or "split" not in job or "num_records" not in job:
        return

    def splits(value: str | None) -> str:
        return "all splits" if value is None else f"--split {value}"

    if job["split"] != split:
        raise PredictionsError(
            f"{predictions} was made with {splits(job['split'])} ({job_path.name}), and its ids are rows of "
            f"that selection; score it with the same, not {splits(split)}"
        )
    if schema is not None and isinstance(job.get("schema"), str) and job["schema"] != schema:
        raise PredictionsError(
            f"{predictions} holds answers in the {job['schema']!r} schema ({job_path.name}); score them with "
            f"--schema {job['schema']}, not {schema}"
        )
    if job["num_records"] != num_records:
        raise PredictionsError(
            f"{predictions} was made on a catalogue of {job['num_records']} records ({job_path.name}); this "
            f"one has {num_records}, so its ids would meet other records' labels"
        )


def coverage_notes(scored: list[int], num_records: int) -> list[str]:
    """What the score covers, where that is not one answer for every record: a shard's predictions
    answer only some records, and an MLPerf log may answer a record twice (a JSONL file may not)."""
    notes = []
    answered = len(set(scored))
    if answered < len(scored):
        notes.append(
            f"{len(scored)} answers for {answered} records ({len(scored) - answered} repeat a record's); "
            "each answer is scored, as the reference's evaluation scores each entry of a LoadGen log"
        )
    if answered < num_records:
        notes.append(f"the predictions answer {answered} of the catalogue's {num_records} records; only those are scored")
    return notes


def resolve_indices(predictions, catalogue) -> list[tuple[int, str]]:
    """Map each prediction's id to a catalogue row; fail listing the ids that match none."""
    resolved: list[tuple[int, str]] = []
    unknown: list[str] = []
    for prediction in predictions:
        try:
            resolved.append((catalogue.index_of(prediction.key), prediction.response))
        except KeyError:
            unknown.append(repr(prediction.key))
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise KeyError(
            f"{len(unknown)} prediction id(s) match no record of the catalogue "
            f"({len(catalogue)} records, ids 0..{len(catalogue) - 1}): {shown}"
        )
    return resolved
