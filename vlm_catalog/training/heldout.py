"""Accuracy of a model directory on a held-out synthetic catalogue, through our engine.

This is what a user gets: `vlm_catalog.LLM(...).extract` with the default
settings (mlperf prompt, per-record constrained decoding, greedy), scored by
the benchmark's metric. The catalogue comes from a generator seed that no
training run uses, written once under `cache_dir` and reused.
"""

from __future__ import annotations

from pathlib import Path

from vlm_catalog.evaluate.scoring import AccuracyReport, score


def heldout_catalogue(cache_dir: Path, seed: int, n: int, image_size: str = "small") -> Path:
    """The catalogue (seed, n, image_size) under `cache_dir`, generated on first use."""
    from vlm_catalog.data.synthetic import make_catalog

    out = cache_dir / f"heldout-{seed}-{n}-{image_size}"
    if not (out / "catalogue.json").is_file():
        make_catalog(out, n=n, seed=seed, image_size=image_size, overwrite=True)
    return out


def evaluate_model(model_dir: Path, catalogue_dir: Path, device: str = "cpu") -> AccuracyReport:
    """Extract every record of `catalogue_dir` with the model in `model_dir` and score it."""
    from vlm_catalog import LLM
    from vlm_catalog.data.loader import load_catalogue

    catalogue = load_catalogue(catalogue_dir)
    records = list(catalogue)
    llm = LLM(model_dir, device=device)
    try:
        results = llm.extract(records)
    finally:
        llm.engine.close()
    return score([(index, result.text) for index, result in enumerate(results)], catalogue.labels())
