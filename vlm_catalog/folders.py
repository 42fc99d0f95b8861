"""A folder a run will write into, checked before the run's long work starts."""

from __future__ import annotations

from pathlib import Path


def make_writable_folder(folder: Path, probe_name: str = ".write-check") -> None:
    """Create `folder` (and its parents) if missing, then write and remove a small file in it.

    Raises OSError (its `strerror` says why: not a directory, permission denied, read-only file
    system, a full disk) when a run could not write there, so the caller can refuse the run in
    one line before hours of work, not fail at its first save.
    """
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / probe_name
    probe.write_text("")
    probe.unlink()
