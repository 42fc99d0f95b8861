"""Files replaced whole or not at all, and the permission bits a new file gets.

A rewrite goes to a hidden temporary file beside the target (`.<name>.XXXXXXXX<suffix>`, the
name `tempfile.mkstemp` makes), which is fsynced and renamed over the target: a crash or a full
disk leaves the old file or the new one, never a mix. A process killed meanwhile leaves the
temporary file; its owner may remove such leftovers (batch/output.py does, holding its lock).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def new_file_mode() -> int:
    """0o666 less the umask: what `open(path, "w")` would give (mkstemp and safetensors make 0o600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def replace_atomically(path: Path, mode: int, fill: Callable[[BinaryIO], object], suffix: str = ".tmp") -> None:
    """Write a temporary file next to `path` with `fill`, fsync it and rename it over `path`. If
    anything fails (a full disk), `path` is untouched and the temporary file is removed."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            fill(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_atomically(path: Path, text: str) -> None:
    """`path` holds `text` (UTF-8), replaced whole, with the mode a new file gets."""
    replace_atomically(path, new_file_mode(), lambda handle: handle.write(text.encode("utf-8")))
