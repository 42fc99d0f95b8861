#!/usr/bin/env python
"""Write a small random Qwen3-VL-MoE checkpoint (no download): tokenizer, config, weights.

    python scripts/make_tiny_checkpoint.py --out scratch/tiny
    python scripts/make_tiny_checkpoint.py --out scratch/odd --set text_layers=3 num_experts=6 \
        experts_per_token=3 head_dim=24 mrope_section=6,3,3 deepstack_visual_indexes=1,2 vision_depth=3

`--set` takes any field of `vlm_catalog.model.tiny_checkpoint.TinySpec`
(tuples as comma-separated values). Both transformers and our loader read the result.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from vlm_catalog.model.tiny_checkpoint import TinySpec, make_tiny_checkpoint


def parse_changes(pairs: list[str]) -> dict:
    fields = {field.name: field for field in dataclasses.fields(TinySpec)}
    changes = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if name not in fields or not value and fields[name].type not in ("tuple[int, ...]",):
            raise SystemExit(f"error: unknown or empty setting {pair!r}; fields: {', '.join(fields)}")
        default = getattr(TinySpec(), name)
        if isinstance(default, bool):
            changes[name] = value.lower() in ("1", "true", "yes")
        elif isinstance(default, tuple):
            changes[name] = tuple(int(v) for v in value.split(",") if v)
        else:
            changes[name] = type(default)(value)
    return changes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args(argv)
    import torch

    spec = TinySpec().with_changes(**parse_changes(args.set))
    path = make_tiny_checkpoint(args.out, spec, seed=args.seed, dtype=getattr(torch, args.dtype))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
