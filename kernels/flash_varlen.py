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

Two providers of the same call (`VLM_CATALOG_FLASH_VARLEN`: ``auto``, the default, ``torch``
or ``fa3``):
* ``torch``: PyTorch's own, FlashAttention 2. On the H100 of 2026-11-27 the vision tower's long
  images ran at about 313 TFLOP/s through it (heads of 72, which it runs as 96), and fresh
  ~2k-token prompts at 244-315.
* ``fa3``: FlashAttention 3, the Hopper kernels (wgmma, TMA, warp specialisation) that vLLM
  runs prefill with on H100s: the module `flash_attn_interface` of a build from source
  (flash-attention/hopper), else `fa3_fwd_interface` of the forward-only wheel on PyPI
  (``pip install fa3-fwd``, the ``.[fa3]`` extra; bf16 only, no paged KV). Used only on a
  compute capability 9.x GPU (its kernels are sm_90's); asked for elsewhere, or where neither
  imports, it falls back to ``torch`` with one warning, and `flash_varlen_provider()` says
  which ran. With FA3 the callers send long sequences to the varlen call too
  (`flash_takes_long_sequences`): the thresholds that send them to per-sequence SDPA were
  measured against FlashAttention 2's varlen call.
* ``auto``: ``fa3`` where it can run, ``torch`` elsewhere, without a warning. On the H200 of
  2026-11-27 the per-channel W8A8 engine ran 17.34 samples/s with FA3 against 14.37 with
  torch's (vision 3.80 s against 5.05, text prefill 6.32 s against 7.98; docs/benchmarks.md),
  and `pytest -m gpu` passed its FA3 tests there.
Failures and the alignment check are kept per provider.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging

import torch

from kernels.dispatch import environment_choice

logger = logging.getLogger(__name__)

FLASH_HEAD_DIMS = range(8, 257, 8)  # what FlashAttention's kernels take
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_DEVICE_TYPES = ("cuda",)  # tests add "cpu" with a stand-in kernel

FLASH_VARLEN_ENV_VAR = "VLM_CATALOG_FLASH_VARLEN"
FLASH_VARLEN_PROVIDERS = ("auto", "torch", "fa3")  # the first is the default
# FlashAttention 3's Python modules: a build from source (flash-attention/hopper), then the
# forward-only wheel on PyPI (fa3-fwd), each with its build's flags beside it
FA3_MODULES = (("flash_attn_interface", "flash_attn_config"), ("fa3_fwd_interface", "fa3_fwd_config"))

_failures: dict[tuple[str, str], str] = {}  # (provider, use) -> its first failure; off for good
_warned: set[str] = set()  # warnings given once per process


def flash_varlen_function():
    """The varlen entry point of the provider in use (`flash_varlen_provider`), or None where
    it has none (a torch without varlen_attn)."""
    if flash_varlen_provider() == "fa3":
        return fa3_varlen_function()
    return torch_varlen_function()


@functools.cache
def torch_varlen_function():
    """torch's FlashAttention varlen entry point, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def flash_varlen_provider() -> str:
    """``fa3`` where FlashAttention 3 loads for this GPU and `VLM_CATALOG_FLASH_VARLEN` is
    ``auto`` (unset) or ``fa3``; else ``torch`` (after one warning, where fa3 was asked for by
    name and cannot run)."""
    choice = environment_choice(FLASH_VARLEN_ENV_VAR, FLASH_VARLEN_PROVIDERS)
    if choice == "torch":
        return "torch"
    if fa3_varlen_function() is not None:
        return "fa3"
    if choice == "fa3" and "fa3" not in _warned:  # the reason is worded only for the one warning
        _warned.add("fa3")
        logger.warning("%s=fa3, but FlashAttention 3 cannot run here (%s): torch's FlashAttention varlen "
                       "call runs instead", FLASH_VARLEN_ENV_VAR, fa3_unavailable_reason())
    return "torch"


def flash_takes_long_sequences() -> bool:
    """Whether the varlen call should take every sequence, long ones too: with FlashAttention 3.
    The length thresholds above which the callers run per-sequence SDPA instead
    (`SDPA_MIN_SEGMENT_LEN`, `SDPA_MIN_PREFILL_LEN`) compare SDPA with FlashAttention 2's varlen
    call; FlashAttention 3 is the faster kernel at every length."""
    return flash_varlen_provider() == "fa3"


class Fa3Varlen:
    """FlashAttention 3's `flash_attn_varlen_func` behind torch's varlen call (its >= 2.11
    keywords): causal is ``window_size=(-1, 0)``; grouped-query K/V go in as they are (FA3 takes
    fewer KV heads natively). `dtypes`: what the build compiled (fa3-fwd leaves float16 out)."""

    def __init__(self, function, module: str, dtypes: tuple[torch.dtype, ...] = FLASH_DTYPES) -> None:
        self.function, self.module, self.dtypes = function, module, dtypes

    def __call__(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                 enable_gqa=False):
        window = tuple(window_size)
        if window not in ((-1, -1), (-1, 0)):
            raise ValueError(f"window_size {window}: only full or causal attention is used here")
        out = self.function(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, softmax_scale=scale,
                            causal=window == (-1, 0))
        return out[0] if isinstance(out, tuple) else out  # older builds return (out, softmax_lse)


def fa3_device_supported() -> bool:
    """Whether this process's GPU runs FlashAttention 3's kernels (compute capability 9.x)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


_fa3_import_errors: list[str] = []


@functools.cache
def fa3_varlen_function() -> Fa3Varlen | None:
    """FlashAttention 3's varlen forward (`FA3_MODULES`, first that imports), or None: not
    installed, its library did not load, or no Hopper GPU here (`fa3_unavailable_reason`)."""
    if not fa3_device_supported():
        return None
    for module_name, config_name in FA3_MODULES:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - not installed, its library did not load (another CUDA or
            # torch: OSError), or its operators did not register (RuntimeError): torch's kernel runs instead
            _fa3_import_errors.append(f"{module_name}: {type(exc).__name__}: {exc}")
            continue
        return Fa3Varlen(module.flash_attn_varlen_func, module_name, _fa3_dtypes(config_name))
    return None


def fa3_unavailable_reason() -> str:
    """Why `fa3_varlen_function()` is None, in words (empty when it is not)."""
    if fa3_varlen_function() is not None:
        return ""
    if not fa3_device_supported():
        return "no GPU of compute capability 9.x (its kernels are Hopper's)"
    tried = "; ".join(_fa3_import_errors) or "no module"
    return f"neither {' nor '.join(name for name, _ in FA3_MODULES)} imports ({tried}); pip install fa3-fwd"


def _fa3_dtypes(config_name: str) -> tuple[torch.dtype, ...]:
    """The 16-bit dtypes an FA3 build compiled, from the flags module it installs beside its
    interface (float16 can be left out: FLASHATTENTION_DISABLE_FP16)."""
    try:
        flags = importlib.import_module(config_name).CONFIG["build_flags"]
    except (ImportError, AttributeError, KeyError, TypeError):
        return FLASH_DTYPES
    return (torch.bfloat16,) if flags.get("FLASHATTENTION_DISABLE_FP16") else FLASH_DTYPES


def flash_varlen_module() -> str:
    """Where the varlen call in use comes from: FA3's module name, or ``torch``."""
    function = flash_varlen_function()
    return function.module if isinstance(function, Fa3Varlen) else "torch"


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
    """Whether the kernel can take q (its dtype and head size) for `use`, if it is installed."""
    if (flash_varlen_provider(), use) in _failures or q.device.type not in FLASH_DEVICE_TYPES:
        return False
    function = flash_varlen_function()
    return (
        function is not None
        and q.dtype in getattr(function, "dtypes", FLASH_DTYPES)
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
    """Why `use` was turned off for the provider in use, or None while it is on."""
    return _failures.get((flash_varlen_provider(), use))


def _turn_off(use: str, reason: str) -> None:
    provider = flash_varlen_provider()
    _failures[(provider, use)] = reason
    logger.warning("FlashAttention varlen (%s) failed for %s attention (%s); its fallback takes over from now on",
                   provider, use, reason)


CAUSAL_WITH_CONTEXT = "causal with context"  # the use that `causal_with_context_supported` guards


def causal_with_context_supported(q: torch.Tensor) -> bool:
    """Whether the kernel aligns the causal mask bottom-right when a segment has more keys than
    queries, checked once per device and dtype on a tiny case against explicit masked attention
    (a kernel that aligns it top-left would be silently wrong there). A failed check turns the
    use off, with the warning."""
    if not flash_varlen_usable(q, CAUSAL_WITH_CONTEXT):  # also False once the use is off
        return False
    key = (flash_varlen_provider(), q.device.type, q.device.index, q.dtype, q.shape[-1])
    if key not in _alignment_checked:
        _alignment_checked.add(key)
        _check_bottom_right(q)  # turns the use off if the check fails
    return (flash_varlen_provider(), CAUSAL_WITH_CONTEXT) not in _failures


# (provider, device type, index, dtype, head size) checked once each
_alignment_checked: set[tuple] = set()


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
