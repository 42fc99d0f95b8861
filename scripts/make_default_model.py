#!/usr/bin/env python
"""Build the default model that ships in data/models/tiny-qwen3-vl-moe (deterministic).

A small Qwen3-VL-MoE (4 text layers of 8 experts, top-2, hidden 128; a 2-layer
vision tower with deepstack) with random weights, and a 4096-entry byte-level
BPE tokenizer trained on the mlperf prompt, the taxonomy subset and the text of
3000 synthetic products (seed 1000, disjoint from the shipped sample), so
catalogue prompts tokenise compactly. Weights are stored in bfloat16.

    python scripts/make_default_model.py --out scratch/training/base [--overwrite]

`--out` has no default and an existing folder is replaced only with `--overwrite`:
the shipped folder holds the trained weights, which this script's random ones would replace.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from vlm_catalog.data.synthetic.records import default_factory
from vlm_catalog.model.tiny_checkpoint import (
    TinySpec,
    TokenizerCorpus,
    build_tokenizer,
    make_tiny_checkpoint,
)
from vlm_catalog.paths import DEFAULT_MODEL_DIR

DEFAULT_SPEC = TinySpec(
    text_layers=4,
    hidden_size=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    mrope_section=(8, 4, 4),
    num_experts=8,
    experts_per_token=2,
    moe_intermediate_size=128,
    intermediate_size=256,
    vision_depth=2,
    vision_hidden_size=64,
    vision_heads=2,
    vision_intermediate_size=128,
    num_position_embeddings=256,
    deepstack_visual_indexes=(0, 1),
    tokenizer_vocab_size=4096,
)
MODEL_README = """# tiny-qwen3-vl-moe

The default model of vlm-catalog: a small Qwen3-VL-MoE (3.3M parameters: 4 text
layers of 8 experts, top-2, hidden 128; a 2-layer vision tower with deepstack)
that serves the demo and the CPU benchmarks. It is trained on synthetic
catalogue extraction only; it is not a general model.

This README comes with the random weights of `scripts/make_default_model.py`;
train them with `scripts/train_default_model.py` (see its --help and the
training section of the shipped model card), e.g.

    python scripts/make_default_model.py --out scratch/training/base
    python scripts/train_default_model.py --base scratch/training/base \
        --run-dir scratch/training/run --steps 3000 --eval-every 200

then copy `scratch/training/run/model/model.safetensors` next to this README.

Training: transformers' Qwen3VLMoeForConditionalGeneration, teacher forcing on
synthetic products shown with the benchmark's mlperf prompt and answered with
compact ProductMetadata JSON (`vlm_catalog/training/`). Weights stored in bfloat16.

Accuracy on the shipped sample: see the README committed next to the weights
(`vlm-catalog demo` measures it).

Shapes: {shapes}
"""
CORPUS_RECORDS = 3000
CORPUS_SEED = 1000


def catalogue_corpus() -> list[str]:
    factory = default_factory()
    texts = []
    for index in range(CORPUS_RECORDS):
        record = factory.make(CORPUS_SEED, index)
        texts.extend([record.title, record.description, str(list(record.candidates)), record.brand])
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the checkpoint folder to write")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.overwrite:
        shipped = " (the shipped, trained model)" if args.out.resolve() == DEFAULT_MODEL_DIR.resolve() else ""
        print(f"error: {args.out}{shipped} exists; pass --overwrite to replace it", file=sys.stderr)
        return 2
    if args.out.exists():
        shutil.rmtree(args.out)
    tokenizer = build_tokenizer(DEFAULT_SPEC.tokenizer_vocab_size, TokenizerCorpus(extra=catalogue_corpus()))
    path = make_tiny_checkpoint(args.out, DEFAULT_SPEC, seed=0, tokenizer=tokenizer, dtype=torch.bfloat16)
    (path / "README.md").write_text(MODEL_README.format(shapes=json.dumps(DEFAULT_SPEC.__dict__)))
    print(f"wrote {path} ({sum(f.stat().st_size for f in path.iterdir()) / 2**20:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
