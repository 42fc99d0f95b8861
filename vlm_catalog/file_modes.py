"""The permission bits a new file gets, for files written by another route (mkstemp, safetensors)."""

from __future__ import annotations

import os


def new_file_mode() -> int:
    """0o666 less the umask: what `open(path, "w")` would give (mkstemp and safetensors make 0o600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
