"""The query sample library: catalogue records, loaded into memory when LoadGen asks.

LoadGen calls `load` with the sample indices it will use before the timed
run, and `unload` afterwards. Loading reads the record (image bytes) and
builds its request (`requests.prepare_request`: messages with the base64
image, the per-record schema), so nothing is read from disk while timed. A
record that cannot be turned into a request is kept as a `LoadedSample` with
its error: the SUT answers it with an empty response (as the reference does
for a failed request) and counts it, instead of aborting the run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import mlperf_loadgen as lg

from schemas import ProductRecord
from vlm_catalog.bench.loadgen.requests import PreparedRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedSample:
    index: int
    request: PreparedRequest | None
    error: str | None = None


class CatalogueQSL:
    """`num_samples` records of `catalogue` as a LoadGen QSL (use as a context manager)."""

    def __init__(
        self,
        catalogue,  # a Sequence[ProductRecord], e.g. data.loader.Catalogue
        num_samples: int,
        performance_sample_count: int,
        prepare: Callable[[ProductRecord], PreparedRequest],
    ) -> None:
        if not 1 <= num_samples <= len(catalogue):
            raise ValueError(f"num_samples must be in 1..{len(catalogue)}, got {num_samples}")
        self.catalogue = catalogue
        self.num_samples = num_samples
        self.performance_sample_count = min(performance_sample_count, num_samples)
        self._prepare = prepare
        self.loaded: dict[int, LoadedSample] = {}
        self.handle = None

    def __enter__(self) -> CatalogueQSL:
        self.handle = lg.ConstructQSL(self.num_samples, self.performance_sample_count, self.load, self.unload)
        return self

    def __exit__(self, *exc_info) -> None:
        if self.handle is not None:
            lg.DestroyQSL(self.handle)
            self.handle = None

    def load(self, indices: list[int]) -> None:
        for index in indices:
            if index not in self.loaded:
                self.loaded[index] = self._load_one(index)

    def unload(self, indices: list[int]) -> None:
        for index in indices:
            self.loaded.pop(index, None)

    def __getitem__(self, index: int) -> LoadedSample:
        return self.loaded[index]

    def _load_one(self, index: int) -> LoadedSample:
        try:
            return LoadedSample(index, self._prepare(self.catalogue[index]))
        except Exception as exc:  # noqa: BLE001 - one bad record must not end the run
            logger.warning("sample %d cannot be prepared: %s", index, exc)
            return LoadedSample(index, None, f"{type(exc).__name__}: {exc}")
