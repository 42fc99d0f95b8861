"""Stand-ins for torch's FlashAttention varlen kernel on CPU (`kernels.flash_varlen`): they
record their calls and answer with per-segment SDPA, with the keywords of two torch versions."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


def segment_attention(q, k, v, cu_seq_q, scale, causal: bool) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]: each segment attends to itself only."""
    out = torch.zeros_like(q)
    for begin, end in itertools.pairwise(cu_seq_q.tolist()):
        if end > begin:
            context = F.scaled_dot_product_attention(
                q[begin:end].transpose(0, 1).unsqueeze(0),  # [1, Hq, n, D]
                k[begin:end].transpose(0, 1).unsqueeze(0),  # [1, Hkv, n, D]
                v[begin:end].transpose(0, 1).unsqueeze(0),
                is_causal=causal, scale=scale, enable_gqa=True,
            )  # [1, Hq, n, D]
            out[begin:end] = context[0].transpose(0, 1)  # [n, Hq, D]
    return out


class FakeFlashVarlen:
    """torch >= 2.11's keywords: `scale`, `window_size` ((-1, 0) is causal), `enable_gqa`
    (without it, fewer KV heads than query heads raise, as in torch). Raises `error` if given."""

    def __init__(self, error: Exception | None = None):
        self.calls, self.error = [], error

    def __call__(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None,
                 window_size=(-1, -1), enable_gqa=False):
        self.calls.append({"cu_seq_q": cu_seq_q, "cu_seq_k": cu_seq_k, "max_q": max_q, "max_k": max_k,
                           "scale": scale, "window_size": window_size, "enable_gqa": enable_gqa})
        if self.error is not None:
            raise self.error
        if key.shape[1] != query.shape[1] and not enable_gqa:
            raise RuntimeError("number of heads in key/value must equal query's without enable_gqa")
        return segment_attention(query, key, value, cu_seq_q, scale, causal=tuple(window_size) == (-1, 0))


class FakeFlashVarlenIsCausal:
    """torch 2.10's keywords: `is_causal` only (no scale, no enable_gqa; fewer KV heads pass as
    they are, as FlashAttention takes them)."""

    def __init__(self):
        self.calls = []

    def __call__(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False):
        self.calls.append({"cu_seq_q": cu_seq_q, "max_q": max_q, "is_causal": is_causal})
        return segment_attention(query, key, value, cu_seq_q, None, causal=is_causal)
