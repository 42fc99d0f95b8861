"""`vlm-catalog check-parity`: compare our model with transformers on a checkpoint."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check-parity",
        description=(
            "Run transformers' Qwen3VLMoeForConditionalGeneration and our model on the same "
            "prompt and images; print the max abs logit difference (prompt positions and every "
            "decode step) and whether greedy generation matches. Exit 1 on a mismatch."
        ),
    )
    parser.add_argument("model_dir", type=Path, help="checkpoint directory")
    parser.add_argument("--image", action="append", type=Path, default=[], help="image file (repeatable)")
    parser.add_argument("--prompt", default="Describe the product in one sentence.", help="user text")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens to compare")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--atol", type=float, default=1e-4, help="logit tolerance (default 1e-4)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", dest="json_out", type=Path, help="write the report as JSON")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from vlm_catalog.model.config import ModelConfigError
    from vlm_catalog.model.loader import CheckpointError
    from vlm_catalog.model.parity import ReferenceUnavailable, check_parity
    from vlm_catalog.preprocess.image_decode import ImageDecodeError
    from vlm_catalog.preprocess.processor import PromptError
    from vlm_catalog.report_file import ReportFileError, check_report_path, write_report

    dtype = getattr(torch, args.dtype)
    atol = args.atol
    if args.tokens < 1:
        print("error: --tokens must be at least 1", file=sys.stderr)
        return 2
    if not (math.isfinite(atol) and atol > 0):  # nan failed every checkpoint, inf passed any
        print(f"error: --atol must be a finite number above 0, got {atol}", file=sys.stderr)
        return 2
    try:
        if args.json_out:
            check_report_path(args.json_out, inputs=(args.model_dir, *args.image))
        images = []
        for path in args.image:
            try:
                images.append(path.read_bytes())
            except OSError as exc:  # a folder, unreadable, missing
                print(f"error: --image {path}: cannot read it ({exc.strerror or exc})", file=sys.stderr)
                return 2
        report = check_parity(args.model_dir, args.prompt, images, args.tokens, dtype, args.device)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (CheckpointError, ModelConfigError, PromptError, ImageDecodeError, ReferenceUnavailable,
            ReportFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    verdict = "PASS" if report.passed(atol) else "FAIL"
    print(f"checkpoint:            {args.model_dir}")
    print(f"prompt tokens:         {report.prompt_tokens} ({report.num_images} image(s))")
    print(f"max abs logit diff:    {report.max_abs_logit_diff:.3e} ({args.dtype}, ours vs transformers)")
    if report.our_error_vs_float32 is None:
        print(f"tolerance:             {atol:.0e}")
    else:
        print(
            f"vs float32 reference:  ours {report.our_error_vs_float32:.3e}, transformers "
            f"{report.reference_error_vs_float32:.3e} (ours may be up to 1.5x + {atol:.0e})"
        )
    print(f"greedy {args.tokens} tokens match: {report.tokens_match}")
    if not report.tokens_match:
        first = report.first_difference
        print(f"  first difference at step {first}: ours {report.ours[first]}, transformers {report.reference[first]}")
        if report.reference_margin_at_difference is not None:
            tie = "a near-tie, accepted" if report.near_tie(atol) else "not a near-tie"
            print(f"  transformers' logits there: its token {report.reference_margin_at_difference:.3e} above ours "
                  f"({tie}: bound {report.low_precision_bound(atol):.3e})")
    print(verdict)
    if args.json_out:
        numbers = {
            "passed": report.passed(atol), "atol": atol, "dtype": args.dtype,
            "prompt_tokens": report.prompt_tokens, "num_images": report.num_images,
            "max_abs_logit_diff": report.max_abs_logit_diff, "tokens_match": report.tokens_match,
            "our_error_vs_float32": report.our_error_vs_float32,
            "reference_error_vs_float32": report.reference_error_vs_float32,
            "reference_margin_at_difference": report.reference_margin_at_difference,
            "ours": report.ours, "reference": report.reference,
        }
        try:
            write_report(args.json_out, json.dumps(numbers, indent=2) + "\n")
        except ReportFileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 0 if report.passed(atol) else 1
