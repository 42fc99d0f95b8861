"""The catalogue format shared by the generator and the loader.

Column names and types are those of `Shopify/product-catalogue`. Our own
catalogues add, next to the parquet files, `attributes.jsonl` (line i: the
richer ground truth of row i) and `catalogue.json` (how it was made).
"""

from __future__ import annotations

TITLE = "product_title"
DESCRIPTION = "product_description"
IMAGE = "product_image"
CANDIDATES = "potential_product_categories"
TRUE_CATEGORY = "ground_truth_category"
TRUE_BRAND = "ground_truth_brand"
TRUE_SECONDHAND = "ground_truth_is_secondhand"

INPUT_COLUMNS = (TITLE, DESCRIPTION, IMAGE, CANDIDATES)
LABEL_COLUMNS = (TRUE_CATEGORY, TRUE_BRAND, TRUE_SECONDHAND)
BENCHMARK_COLUMNS = INPUT_COLUMNS + LABEL_COLUMNS

# Short names a JSONL catalogue may use instead of the dataset's column names.
SHORT_COLUMN_NAMES = {
    "title": TITLE,
    "description": DESCRIPTION,
    "image": IMAGE,
    "candidates": CANDIDATES,
    "candidate_categories": CANDIDATES,
    "category": TRUE_CATEGORY,
    "brand": TRUE_BRAND,
    "is_secondhand": TRUE_SECONDHAND,
}

DATA_DIR = "data"
ATTRIBUTES_FILE = "attributes.jsonl"
MANIFEST_FILE = "catalogue.json"


class CatalogueError(ValueError):
    """A catalogue that cannot be read or written; the message names the source and the problem."""


def catalogue_features():
    """The `datasets.Features` of the seven benchmark columns (`datasets` imported lazily: slow)."""
    from datasets import Features, Image, Value

    return Features(
        {
            TITLE: Value("string"),
            DESCRIPTION: Value("string"),
            IMAGE: Image(),
            CANDIDATES: [Value("string")],
            TRUE_CATEGORY: Value("string"),
            TRUE_BRAND: Value("string"),
            TRUE_SECONDHAND: Value("bool"),
        }
    )
