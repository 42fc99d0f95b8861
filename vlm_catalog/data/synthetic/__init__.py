"""Synthetic product catalogue with the columns of `Shopify/product-catalogue`."""

from vlm_catalog.data.format import CatalogueError, catalogue_features
from vlm_catalog.data.synthetic.generator import COLUMNS, make_catalog, parquet_path
from vlm_catalog.data.synthetic.records import RecordFactory, SyntheticRecord

__all__ = [
    "COLUMNS",
    "CatalogueError",
    "RecordFactory",
    "SyntheticRecord",
    "catalogue_features",
    "make_catalog",
    "parquet_path",
]
