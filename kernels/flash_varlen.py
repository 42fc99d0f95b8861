"""PyTorch's FlashAttention varlen kernel (`torch.nn.attention.varlen.varlen_attn`), called
the way both of its users need: the vision tower (bidirectional within each image) and
fresh text prompts (causal, grouped-query).

Packed q [N, Hq, D], k and v [N, Hkv, D]; segment i is rows ``cu_seqlens[i]:cu_seqlens[i+1]``
of all three, and attends only to itself. One launch for every segment, nothing copied.

The kernel's keywords moved between torch versions, so the call is built from the
signature of the one installed: causal is ``window_size=(-1, 0)`` (torch >= 2.11) or
``is_causal=True`` (2.10); ``enable_gqa`` is passed where it exists (elsewhere the kernel
is given fewer KV heads as it is); ``scale`` only when it is not the default 1/sqrt(D).
A call that raises turns the kernel off for that use (``bidirectional`` or ``causal``)
for the rest of the process, with one warning: the caller's own fallback takes over.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch

logger = logging.getLogger(__name__)

FLASH_HEAD_DIMS = range(8, 257, 8)  # what FlashAttention's kernels take
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_DEVICE_TYPES = ("cuda",)  # tests add "cpu" with a stand-in kernel

_failures: dict[str, str] = {}  # use -> its first failure; the use is off for good


@functools.cache
def flash_varlen_function():
    """torch's FlashAttention varlen entry point, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _keywords(function) -> frozenset[str] | None:
    """The keyword names `function` takes; None when it takes any (``**kwargs``)."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters)


def flash_varlen_options(
    function, q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool
) -> dict[str, object] | None:
    """The keyword arguments `function` needs for this call, or None when it cannot express it
    (causal or a non-default scale on a version without the keyword)."""
    accepted = _keywords(function)

    def takes(name: str) -> bool:
        return accepted is None or name in accepted

    options: dict[str, object] = {}
    if scale != q.shape[-1] ** -0.5:
        if not takes("scale"):
            return None
        options["scale"] = scale
    if causal:
        if takes("window_size"):
            options["window_size"] = (-1, 0)
        elif takes("is_causal"):
            options["is_causal"] = True
        else:
            return None
    if k.shape[1] != q.shape[1] and takes("enable_gqa"):
        options["enable_gqa"] = True
    return options


def flash_varlen_usable(q: torch.Tensor, use: str) -> bool:
    """Whether the kernel can take q (its dtype and head size) for `use`, if this torch has it."""
    return (
        use not in _failures
        and q.device.type in FLASH_DEVICE_TYPES
        and flash_varlen_function() is not None
        and q.dtype in FLASH_DTYPES
        and q.shape[-1] in FLASH_HEAD_DIMS
    )


def flash_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    max_seqlen: int,
    *,
    causal: bool = False,
) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D], every segment in one launch; `max_seqlen`
    on the host. Raises what the kernel raises (ValueError if this torch cannot express the call)."""
    function = flash_varlen_function()
    options = flash_varlen_options(function, q, k, scale, causal)
    if options is None:
        raise ValueError(f"torch {torch.__version__}'s varlen_attn takes no {'causal' if causal else 'scale'} keyword")
    bounds = cu_seqlens.to(torch.int32)
    return function(q, k, v, bounds, bounds, max_seqlen, max_seqlen, **options)


def try_flash_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    max_seqlen: int,
    *,
    causal: bool,
    use: str,
) -> torch.Tensor | None:
    """`flash_varlen_attention`, or None after its first failure for `use` (logged once; the
    caller runs its own fallback, now and from then on)."""
    try:
        return flash_varlen_attention(q, k, v, cu_seqlens, scale, max_seqlen, causal=causal)
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
        _failures[use] = f"{type(exc).__name__}: {exc}"
        logger.warning("FlashAttention varlen failed for %s attention (%s); its fallback takes over from now on",
                       use, _failures[use])
        return None
