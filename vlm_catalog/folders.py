"""A folder a run will write into, checked before the run's long work starts."""

from __future__ import annotations

import errno
import os
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


def check_folder_can_be_made(folder: Path, probe_name: str = ".write-check") -> None:
    """Raise OSError (as `make_writable_folder`) where a run could not write into `folder`, making
    nothing: an existing folder is probed with a small file; a missing one needs its nearest
    existing parent to be a folder this process may create entries in. A start refused later
    (a model that does not load) then leaves no empty folder behind."""
    if folder.is_dir():
        make_writable_folder(folder, probe_name)
        return
    parent = folder.absolute()
    while not os.path.lexists(parent):  # a dangling link is in the way, as it is for mkdir
        parent = parent.parent
    if parent == folder.absolute() or not parent.is_dir():
        raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(parent))
    if not os.access(parent, os.W_OK | os.X_OK):  # EACCES, or EROFS on a read-only file system
        raise OSError(errno.EACCES, f"cannot create {folder} in {parent}", str(parent))
