"""Stand-ins for torch's FlashAttention varlen kernel on CPU (`kernels.flash_varlen`): they
record their calls and answer with per-segment SDPA, with the keywords of two torch versions."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


def segment_attention(q, k, v, cu_seq_q, scale, causal: bool, cu_seq_k=None, align: str = "bottom-right"):
    """q [N, Hq, D], k/v [Nk, Hkv, D] -> [N, Hq, D]: segment i's queries attend to its keys only
    (rows of `cu_seq_k`, default `cu_seq_q`); causal masks aligned as FlashAttention's
    (bottom-right: query j of n sits at key position L - n + j) unless `align="top-left"`."""
    key_bounds = itertools.pairwise((cu_seq_q if cu_seq_k is None else cu_seq_k).tolist())
    out = torch.zeros_like(q)
    for (begin, end), (key_begin, key_end) in zip(itertools.pairwise(cu_seq_q.tolist()), key_bounds):
        n, length = end - begin, key_end - key_begin
        if n == 0:
            continue
        mask = None
        if causal:
            offset = length - n if align == "bottom-right" else 0
            mask = torch.arange(length)[None, :] <= (torch.arange(n) + offset)[:, None]  # [n, L], True: seen
        context = F.scaled_dot_product_attention(
            q[begin:end].transpose(0, 1).unsqueeze(0),  # [1, Hq, n, D]
            k[key_begin:key_end].transpose(0, 1).unsqueeze(0),  # [1, Hkv, L, D]
            v[key_begin:key_end].transpose(0, 1).unsqueeze(0),
            attn_mask=None if mask is None else mask.to(q.device), scale=scale, enable_gqa=True,
        )  # [1, Hq, n, D]
        out[begin:end] = context[0].transpose(0, 1)  # [n, Hq, D]
    return out


class FakeFlashVarlen:
    """torch >= 2.11's keywords: `scale`, `window_size` ((-1, 0) is causal), `enable_gqa`
    (without it, fewer KV heads than query heads raise, as in torch). Raises `error` if given;
    `align="top-left"` plays a kernel whose causal mask is aligned the other way."""

    def __init__(self, error: Exception | None = None, align: str = "bottom-right"):
        self.calls, self.error, self.align = [], error, align

    def __call__(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None,
                 window_size=(-1, -1), enable_gqa=False):
        self.calls.append({"cu_seq_q": cu_seq_q, "cu_seq_k": cu_seq_k, "max_q": max_q, "max_k": max_k,
                           "scale": scale, "window_size": window_size, "enable_gqa": enable_gqa,
                           "num_keys": key.shape[0]})
        if self.error is not None:
            raise self.error
        if key.shape[1] != query.shape[1] and not enable_gqa:
            raise RuntimeError("number of heads in key/value must equal query's without enable_gqa")
        return segment_attention(query, key, value, cu_seq_q, scale, causal=tuple(window_size) == (-1, 0),
                                 cu_seq_k=cu_seq_k, align=self.align)


class FakeFlashVarlenIsCausal:
    """torch 2.10's keywords: `is_causal` only (no scale, no enable_gqa; fewer KV heads pass as
    they are, as FlashAttention takes them)."""

    def __init__(self):
        self.calls = []

    def __call__(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False):
        self.calls.append({"cu_seq_q": cu_seq_q, "cu_seq_k": cu_seq_k, "max_q": max_q, "is_causal": is_causal})
        return segment_attention(query, key, value, cu_seq_q, None, causal=is_causal, cu_seq_k=cu_seq_k)


class FakeFa3Varlen:
    """FlashAttention 3's `flash_attn_varlen_func` (its keywords: `softmax_scale`, `causal`;
    fewer KV heads taken as they are), answering with per-segment SDPA and recording its calls.
    `returns_lse`: an older build's (out, softmax_lse) result."""

    def __init__(self, error: Exception | None = None, returns_lse: bool = False):
        self.calls, self.error, self.returns_lse = [], error, returns_lse

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                 seqused_k=None, softmax_scale=None, causal=False, **rest):
        self.calls.append({"cu_seq_q": cu_seqlens_q, "cu_seq_k": cu_seqlens_k, "max_q": max_seqlen_q,
                           "max_k": max_seqlen_k, "softmax_scale": softmax_scale, "causal": causal,
                           "num_kv_heads": k.shape[1], "rest": rest})
        if self.error is not None:
            raise self.error
        out = segment_attention(q, k, v, cu_seqlens_q, softmax_scale, causal=causal, cu_seq_k=cu_seqlens_k)
        return (out, torch.zeros(q.shape[1], q.shape[0])) if self.returns_lse else out


def fa3_modules(function, interface: str = "fa3_fwd_interface", float16: bool = False) -> dict:
    """sys.modules entries of an FA3 install: its interface with `function` and the build-flags
    module beside it (fa3-fwd leaves float16 out)."""
    import types

    config = {"fa3_fwd_interface": "fa3_fwd_config", "flash_attn_interface": "flash_attn_config"}[interface]
    module, flags = types.ModuleType(interface), types.ModuleType(config)
    module.flash_attn_varlen_func = function
    flags.CONFIG = {"build_flags": {"FLASHATTENTION_DISABLE_FP16": not float16}}
    return {interface: module, config: flags}
