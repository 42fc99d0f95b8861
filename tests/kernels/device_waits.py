"""`DeviceWaits`: the ops of a block that would make the host wait for a CUDA device, read on
CPU tensors (the default test run has no GPU; tests/engine/test_host_syncs.py checks the same
on one under CUDA's sync debug mode)."""

from __future__ import annotations

import collections
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops whose result the host must read from the device (a sync on CUDA); bincount reads its
# input's maximum back to size its output
HOST_READS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique", "_unique2",
              "unique_dim", "unique_consecutive", "is_nonzero", "equal", "bincount"}


def _uploading() -> bool:
    """Whether `vlm_catalog.device_upload.upload` is on the Python stack (its copies do not block)."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "upload" and frame.f_code.co_filename.endswith("device_upload.py"):
            return True
        frame = frame.f_back
    return False


class DeviceWaits(TorchDispatchMode):
    """Collects the ops that would make the host wait for a CUDA device: reads of a device value
    (`.item()`, `nonzero`, a boolean index, `repeat_interleave` by device counts without its
    `output_size`), and host data copied to the device other than through `upload` (`torch.tensor`
    with a device, or a pageable `.to()`: torch synchronizes the stream for those)."""

    def __init__(self):
        super().__init__()
        self.waits: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            self.waits[name] += 1
        elif name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and kwargs.get("output_size") is None:
            self.waits["repeat_interleave without output_size"] += 1
        elif name in ("index", "index_put", "index_put_") and any(
                index is not None and index.dtype == torch.bool for index in args[1]):
            self.waits[f"{name} by a boolean mask"] += 1
        elif name in ("lift_fresh", "lift_fresh_copy") and not _uploading():
            self.waits["host data copied to the device (torch.tensor; use device_upload.upload)"] += 1
        return func(*args, **kwargs)
