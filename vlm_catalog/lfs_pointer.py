"""Git LFS pointers: what a model or dataset repository holds when cloned without `git lfs`.

Cloning a Hugging Face repository with plain `git clone` leaves each large file
(weights, parquet shards, a big tokenizer.json, images) as a ~130-byte text
file starting with `version https://git-lfs.github.com/spec/`. Read as data,
it fails with an error about a corrupt header or bad JSON; these helpers name
the real cause and the fix instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

POINTER_PREFIX = b"version https://git-lfs.github.com/spec/"
MAX_POINTER_BYTES = 1024  # a pointer is three short lines


def is_lfs_pointer(data: bytes) -> bool:
    return len(data) <= MAX_POINTER_BYTES and data.startswith(POINTER_PREFIX)


def first_lfs_pointer(paths: Iterable[Path]) -> Path | None:
    """The first file among `paths` that is an LFS pointer (None if none is)."""
    for path in paths:
        try:
            if path.is_file() and path.stat().st_size <= MAX_POINTER_BYTES:
                with path.open("rb") as handle:
                    if is_lfs_pointer(handle.read(MAX_POINTER_BYTES + 1)):
                        return path
        except OSError:
            continue  # unreadable: the reader that needs it reports that
    return None


def pointer_message(path: Path) -> str:
    return (
        f"{path} is a Git LFS pointer, not the file itself (the repository was cloned without its "
        "LFS files); run `git lfs pull` in the repository"
    )
