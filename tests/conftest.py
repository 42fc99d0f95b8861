"""Shared fixtures: small labelled catalogues built in the test itself (no hub access)."""

from __future__ import annotations

import io
import json
import os
import re
import struct
import sys
import zlib
from pathlib import Path

import datasets
import pytest
import torch
from PIL import Image

# Triton under the interpreter where there is no CUDA device, set before any test module is
# collected: triton builds its language functions (tl.zeros, tl.max, ...) for the compiler or
# the interpreter when it is first imported, so a test module that imported triton before
# tests/kernels/ asked for the interpreter failed every kernel test after it in its process
# (tests/kernels/conftest.py says the rest)
if not torch.cuda.is_available() and "kernels.jit" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Each pytest-xdist worker computes on one thread (and so do the processes its tests start): the
# workers already fill the cores, and two OpenMP threads per worker on shared cores wait on each
# other at every barrier. On the 2-core VM under load, tests/engine/test_engine_behaviour.py and
# tests/batch/test_bad_data.py on 2 workers took 154 s with 2 threads each and 19 s with 1.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if os.environ["OMP_NUM_THREADS"].isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:  # not "4,2" or ""
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from vlm_catalog.data.format import catalogue_features

CATALOGUE_FEATURES = catalogue_features()

# where a test marked `fast_path(*names)` fails, its names are appended to the file this variable
# names, one per line (scripts/gpu_session.py sets it, and runs its later steps with those names
# in VLM_CATALOG_KERNELS_OFF: a faster path that fails its GPU test is left out of the record)
FAILED_FAST_PATHS_ENV_VAR = "VLM_CATALOG_FAILED_FAST_PATHS"


def fast_path_names(item) -> list[str]:
    return [name for marker in item.iter_markers("fast_path") for name in marker.args]


def pytest_collection_modifyitems(config, items):
    from kernels.dispatch import FAST_PATHS, KERNEL_OPS

    for item in items:
        unknown = sorted(set(fast_path_names(item)) - FAST_PATHS - KERNEL_OPS)
        if unknown:
            raise pytest.UsageError(f"{item.nodeid}: fast_path({', '.join(unknown)}) names no op or fast path "
                                    "of kernels.dispatch (KERNEL_OPS, FAST_PATHS)")


# errors after which a process's CUDA context is lost: every later test of this pytest-xdist
# worker fails with one, whatever its own code does
CUDA_CONTEXT_LOST = re.compile(r"illegal memory access|device-side assert|unspecified launch failure|"
                               r"misaligned address|illegal instruction|CUDA error: an? illegal")
_cuda_context_lost_in: list[str] = []  # the test of this worker that lost it, once it has


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's fast paths go to the session's file, "name<TAB>test" per line. Once a test
    has lost this worker's CUDA context (it is named, the likeliest culprit), the later failures
    of the worker are its echo: they name nothing, so sound fast paths stay on in the record."""
    report = (yield).get_result()
    target = os.environ.get(FAILED_FAST_PATHS_ENV_VAR)
    names = fast_path_names(item)
    if not report.failed or not target:
        return
    if _cuda_context_lost_in:
        return
    if CUDA_CONTEXT_LOST.search(getattr(report, "longreprtext", "") or ""):
        _cuda_context_lost_in.append(item.nodeid)
    if names:
        with open(target, "a") as failed:  # appends of a line: whole, from pytest-xdist's workers too
            failed.write("".join(f"{name}\t{item.nodeid}\n" for name in names))


def jpeg_bytes(colour: tuple[int, int, int], size: tuple[int, int] = (48, 40)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def write_lfs_pointer(path: Path) -> None:
    """What `git clone` without git-lfs leaves in place of a large file."""
    path.write_text("version https://git-lfs.github.com/spec/v1\n"
                    "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 6615504\n")


def png_bomb() -> bytes:
    """A 69-byte PNG whose header claims 100000 x 100000 pixels (a decompression bomb)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 100000, 100000, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00")) + chunk(b"IEND", b""))


def handmade_rows() -> list[dict]:
    """Three products with known labels, enough to check loaders and scoring by hand."""
    return [
        {
            "product_title": "Acme Bird Bath",
            "product_description": "<div>A bath for birds by <b>Acme</b></div>",
            "product_image": {"bytes": jpeg_bytes((200, 30, 30)), "path": None},
            "potential_product_categories": [
                "Animals & Pet Supplies > Pet Supplies > Bird Supplies > Bird Toys",
                "Animals & Pet Supplies > Pet Supplies > Bird Supplies > Bird Cage Accessories",
            ],
            "ground_truth_category": "Animals & Pet Supplies > Pet Supplies > Bird Supplies > Bird Cage Accessories",
            "ground_truth_brand": "Acme",
            "ground_truth_is_secondhand": False,
        },
        {
            "product_title": "Pre-owned Zed Polo",
            "product_description": "Gently used polo shirt.",
            "product_image": {"bytes": jpeg_bytes((20, 20, 200)), "path": None},
            "potential_product_categories": [
                "Apparel & Accessories > Clothing > Shirts & Tops",
                "Apparel & Accessories > Clothing > Pants",
            ],
            "ground_truth_category": "Apparel & Accessories > Clothing > Shirts & Tops",
            "ground_truth_brand": "Zed Clothing",
            "ground_truth_is_secondhand": True,
        },
        {
            "product_title": "Lamp",
            "product_description": "A desk lamp.",
            "product_image": {"bytes": jpeg_bytes((240, 240, 40), (32, 64)), "path": None},
            "potential_product_categories": ["Home & Garden > Lighting > Lamps", "Home & Garden > Decor"],
            "ground_truth_category": "Home & Garden > Lighting > Lamps",
            "ground_truth_brand": "Lumo",
            "ground_truth_is_secondhand": False,
        },
    ]


def write_catalogue(directory: Path, rows: list[dict], split: str = "test") -> Path:
    columns = {name: [row[name] for row in rows] for name in CATALOGUE_FEATURES}
    dataset = datasets.Dataset.from_dict(columns, features=CATALOGUE_FEATURES)
    (directory / "data").mkdir(parents=True, exist_ok=True)
    dataset.to_parquet(str(directory / "data" / f"{split}-00000-of-00001.parquet"))
    return directory


@pytest.fixture
def handmade_catalogue(tmp_path: Path) -> Path:
    directory = write_catalogue(tmp_path / "catalogue", handmade_rows())
    attributes = [
        {"colour": "red", "material": "ceramic", "target_gender": "unisex", "age_group": "all ages", "condition": "new"},
        {"colour": "blue", "material": "cotton", "target_gender": "male", "age_group": "adult", "condition": "used"},
        {"colour": "yellow", "material": "metal", "target_gender": "unisex", "age_group": "adult", "condition": "new"},
    ]
    (directory / "attributes.jsonl").write_text("".join(json.dumps(a) + "\n" for a in attributes))
    return directory
