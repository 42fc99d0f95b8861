"""Host-to-device copies of a step's small inputs that do not make the host wait.

Every step builds its inputs on the host (token ids, positions, KV slots, block
tables, lengths, the sampler's per-row settings) and copies them to the device.
`torch.tensor(data, device="cuda")` and `tensor.to("cuda")` from ordinary
(pageable) memory synchronize the stream: the host waits until the device has
finished everything queued before the copy. `upload` stages the data in pinned
memory and copies it asynchronously instead, so the host can prepare step N+1
while the device still runs step N (`EngineConfig.async_scheduling`). PyTorch's
caching host allocator keeps each pinned buffer until its copy has completed.

On CPU it is a plain conversion.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(data: torch.Tensor | Sequence, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`data` (a host tensor or a list of numbers) as a tensor on `device`, in `dtype` if given."""
    tensor = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.contiguous().pin_memory().to(device, non_blocking=True)
