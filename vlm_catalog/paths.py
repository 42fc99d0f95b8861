"""Where the repository's shipped data lives (sample catalogue, taxonomy, default model).

The data ships in the source checkout's `data/` folder, not in an installed package: an install
from a wheel or `pip install <checkout>` (not `-e`) finds it through `VLM_CATALOG_DATA`.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_ENV = "VLM_CATALOG_DATA"
DATA_DIR = Path(os.environ.get(DATA_ENV, REPO_ROOT / "data"))
SAMPLE_CATALOGUE_DIR = DATA_DIR / "sample_catalogue"
TAXONOMY_FILE = DATA_DIR / "taxonomy" / "shopify_categories_subset.txt"
DEFAULT_MODEL_DIR = DATA_DIR / "models" / "tiny-qwen3-vl-moe"


def shipped_data_hint(path: str | Path) -> str:
    """A sentence to add to an error about a missing `path`, where `path` lies in the shipped data
    folder and that folder is absent (an installed package, or `VLM_CATALOG_DATA` set wrong); ""
    otherwise."""
    if DATA_DIR.is_dir() or not Path(path).absolute().is_relative_to(DATA_DIR.absolute()):
        return ""
    where = f"{DATA_ENV}={DATA_DIR}" if DATA_ENV in os.environ else "this installed package"
    return (f"; the default model, sample catalogue and taxonomy ship in the source checkout's data/ folder, "
            f"and {where} has none: set {DATA_ENV}=<checkout>/data, or give the path")
