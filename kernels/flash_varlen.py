"""PyTorch's FlashAttention varlen kernel (`torch.nn.attention.varlen.varlen_attn`), called
the way both of its users need: the vision tower (bidirectional within each image) and
fresh text prompts (causal, grouped-query).

Packed q [N, Hq, D], k and v [N, Hkv, D]; segment i is rows ``cu_seqlens[i]:cu_seqlens[i+1]``
of all three, and attends only to itself. One launch for every segment, nothing copied.
Keys may be packed apart from the queries (`cu_seqlens_k`: a chunk of new tokens attending
to its whole context); the causal mask is then aligned bottom-right (query j of n sits at
key position L - n + j), which FlashAttention does and `causal_with_context_supported`
checks once per device on a small case before the engine relies on it.

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
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hkv, D] (or [Nk, Hkv, D] packed by `cu_seqlens_k`) -> [N, Hq, D],
    every segment in one launch; the max lengths on the host. Raises what the kernel raises
    (ValueError if this torch cannot express the call)."""
    function = flash_varlen_function()
    options = flash_varlen_options(function, q, k, scale, causal)
    if options is None:
        raise ValueError(f"torch {torch.__version__}'s varlen_attn takes no {'causal' if causal else 'scale'} keyword")
    bounds = cu_seqlens.to(torch.int32)
    key_bounds = bounds if cu_seqlens_k is None else cu_seqlens_k.to(torch.int32)
    max_k = max_seqlen if max_seqlen_k is None else max_seqlen_k
    return function(q, k, v, bounds, key_bounds, max_seqlen, max_k, **options)


def try_flash_varlen_attention(use: str, *args, **kwargs) -> torch.Tensor | None:
    """`flash_varlen_attention(*args, **kwargs)`, or None after its first failure for `use`
    (logged once; the caller runs its own fallback, now and from then on)."""
    try:
        return flash_varlen_attention(*args, **kwargs)
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
        _turn_off(use, f"{type(exc).__name__}: {exc}")
        return None


def failure_reason(use: str) -> str | None:
    """Why `use` was turned off, or None while it is on."""
    return _failures.get(use)


def _turn_off(use: str, reason: str) -> None:
    _failures[use] = reason
    logger.warning("FlashAttention varlen failed for %s attention (%s); its fallback takes over from now on",
                   use, reason)


CAUSAL_WITH_CONTEXT = "causal with context"  # the use that `causal_with_context_supported` guards


def causal_with_context_supported(q: torch.Tensor) -> bool:
    """Whether the kernel aligns the causal mask bottom-right when a segment has more keys than
    queries, checked once per device and dtype on a tiny case against explicit masked attention
    (a kernel that aligns it top-left would be silently wrong there). A failed check turns the
    use off, with the warning."""
    if not flash_varlen_usable(q, CAUSAL_WITH_CONTEXT):  # also False once the use is off
        return False
    key = (q.device.type, q.device.index, q.dtype, q.shape[-1])
    if key not in _alignment_checked:
        _alignment_checked.add(key)
        _check_bottom_right(q)  # turns the use off if the check fails
    return CAUSAL_WITH_CONTEXT not in _failures


_alignment_checked: set[tuple] = set()  # (device type, index, dtype, head size) checked once each


def _check_bottom_right(like: torch.Tensor) -> None:
    """Two segments (3 queries over 7 keys, 2 over 2) through the kernel vs float32 math; a
    failure or a mismatch turns CAUSAL_WITH_CONTEXT off."""
    generator = torch.Generator().manual_seed(0)
    head_dim = like.shape[-1]
    query_lens, key_lens = [3, 2], [7, 2]
    q, k, v = (torch.randn(sum(lengths), 2, head_dim, generator=generator)
               for lengths in (query_lens, key_lens, key_lens))  # [n, H, D]
    expected = []
    for start_q, n, start_k, length in zip((0, 3), query_lens, (0, 7), key_lens):
        scores = torch.einsum("qhd,khd->hqk", q[start_q:start_q + n], k[start_k:start_k + length]) * head_dim**-0.5
        hidden = torch.arange(length)[None, :] > torch.arange(length - n, length)[:, None]  # [n, L]
        weights = scores.masked_fill(hidden, float("-inf")).softmax(-1)  # [H, n, L]
        expected.append(torch.einsum("hqk,khd->qhd", weights, v[start_k:start_k + length]))
    expected = torch.cat(expected)  # [5, H, D]
    on_device = [x.to(like.dtype).to(like.device) for x in (q, k, v)]
    bounds_q = torch.tensor([0, 3, 5], dtype=torch.int32, device=like.device)
    bounds_k = torch.tensor([0, 7, 9], dtype=torch.int32, device=like.device)
    try:
        out = flash_varlen_attention(*on_device, bounds_q, head_dim**-0.5, 3, causal=True,
                                     cu_seqlens_k=bounds_k, max_seqlen_k=7)
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
        _turn_off(CAUSAL_WITH_CONTEXT, f"{type(exc).__name__}: {exc}")
        return
    error = (out.float().cpu() - expected).abs().max().item()
    if error > 0.05 * expected.abs().max().item():  # 16-bit inputs: ~1e-2 when aligned, O(1) when not
        _turn_off(CAUSAL_WITH_CONTEXT, f"its causal mask is not aligned bottom-right (max error {error:.3g})")
