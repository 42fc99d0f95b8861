#!/usr/bin/env python
"""Write a small random Qwen3-VL-MoE checkpoint (no download): tokenizer, config, weights.

    python scripts/make_tiny_checkpoint.py --out scratch/tiny
    python scripts/make_tiny_checkpoint.py --out scratch/odd --set text_layers=3 num_experts=6 \
        experts_per_token=3 head_dim=24 mrope_section=6,3,3 deepstack_visual_indexes=1,2 vision_depth=3

`--set` takes any field of `vlm_catalog.model.tiny_checkpoint.TinySpec`
(tuples as comma-separated values). Both transformers and our loader read the result.
An `--out` that holds files is replaced only with `--overwrite` (data/models/tiny-qwen3-vl-moe
holds the trained weights, which these random ones would replace); the checkpoint is built
beside it and moved into place once whole, so a failed build leaves `--out` as it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

from vlm_catalog.folders import check_folder_can_be_made
from vlm_catalog.model.tiny_checkpoint import TinySpec, TinySpecError, make_tiny_checkpoint
from vlm_catalog.paths import DEFAULT_MODEL_DIR


def parse_changes(pairs: list[str]) -> dict:
    """`--set` pairs as TinySpec changes; `TinySpecError` for an unknown field or a value of the wrong type."""
    fields = {field.name: field for field in dataclasses.fields(TinySpec)}
    changes = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if name not in fields or not value and fields[name].type not in ("tuple[int, ...]",):
            raise TinySpecError(f"unknown or empty setting {pair!r}; fields: {', '.join(fields)}")
        default = getattr(TinySpec(), name)
        try:
            if isinstance(default, bool):
                changes[name] = value.lower() in ("1", "true", "yes")
            elif isinstance(default, tuple):
                changes[name] = tuple(int(v) for v in value.split(",") if v)
            else:
                changes[name] = type(default)(value)
        except ValueError:
            kind = "comma-separated integers" if isinstance(default, tuple) else (
                "an integer" if isinstance(default, int) else "a number")
            raise TinySpecError(f"--set {pair}: {name} takes {kind}, got {value!r}") from None
    return changes


def out_problem(out: Path, overwrite: bool) -> str | None:
    """Why the checkpoint cannot go to `out` (None: it can); nothing is created."""
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file; a checkpoint is a folder"
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        shipped = " (the shipped, trained model)" if out.resolve() == DEFAULT_MODEL_DIR.resolve() else ""
        return f"{out}{shipped} exists; pass --overwrite to replace it"
    try:
        check_folder_can_be_made(out.parent, f".{out.name}.write-check")
    except OSError as exc:
        return f"--out {out} cannot be written: {exc.strerror or exc}"
    return None


def write_in_place(out: Path, build) -> None:
    """`build(folder)` writes a checkpoint into a new folder beside `out`, which then takes `out`'s
    place (the old one, if any, is removed after): a build that fails or is interrupted leaves
    `out` as it was, and no half-made folder."""
    anchor = out.absolute().parent
    while not anchor.exists():  # the scratch folder must be on out's file system, in a folder that exists
        anchor = anchor.parent
    with tempfile.TemporaryDirectory(dir=anchor, prefix=f".{out.name}.") as scratch:
        built = build(Path(scratch) / "new")
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            out.rename(Path(scratch) / "old")  # removed with the scratch folder
        built.rename(out)


def refused(problem: str) -> int:
    print(f"error: {problem}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args(argv)
    import torch

    try:
        spec = TinySpec().with_changes(**parse_changes(args.set))
    except TinySpecError as exc:
        return refused(str(exc))
    problem = out_problem(args.out, args.overwrite)
    if problem is not None:
        return refused(problem)
    try:
        write_in_place(args.out, lambda folder: make_tiny_checkpoint(
            folder, spec, seed=args.seed, dtype=getattr(torch, args.dtype)))
    except TinySpecError as exc:  # shapes that do not fit together: found before anything is written
        return refused(str(exc))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
