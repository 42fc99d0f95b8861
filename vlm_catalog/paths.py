"""Where the repository's shipped data lives (sample catalogue, taxonomy, default model)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = Path(os.environ.get("VLM_CATALOG_DATA", REPO_ROOT / "data"))
SAMPLE_CATALOGUE_DIR = DATA_DIR / "sample_catalogue"
TAXONOMY_FILE = DATA_DIR / "taxonomy" / "shopify_categories_subset.txt"
DEFAULT_MODEL_DIR = DATA_DIR / "models" / "tiny-qwen3-vl-moe"
