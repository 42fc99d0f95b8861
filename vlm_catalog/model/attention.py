"""The interface between the decoder's attention layers and a KV cache.

The decoder runs on a flat batch of tokens from many sequences. Each attention
layer computes q, k, v for those tokens and hands them to an
`AttentionBackend`, which stores k and v in its cache and returns every token's
attention over its own sequence's cached tokens and itself (causal). All
per-step layout (which tokens belong to which sequence, where their cache
lives) belongs to the backend, so the model's code stays
`forward(input_ids, positions, attention)` whatever the cache is.

`ContiguousKVCache` is the simplest backend: one growing K/V tensor per sequence
and layer. It serves standalone runs (the parity command, tests). The serving
engine's paged backend lives in `vlm_catalog/engine/`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence

import torch
import torch.nn.functional as F

import kernels


class AttentionBackend(ABC):
    @abstractmethod
    def attend(
        self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        qk_norm_rope: kernels.QKNormRope | None = None,
    ) -> torch.Tensor:
        """Store k/v of this step's tokens and attend: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D].
        `qk_norm_rope`: q and k are raw, and get it first (what k is stored as included); a
        backend may apply it inside its attention kernel."""

    def attend_rows(
        self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        qk_norm_rope: kernels.QKNormRope | None = None,
    ) -> list[torch.Tensor]:
        """`attend`'s answer as consecutive pieces of its rows ([T_i, Hq, D], in order; stacked they
        are `attend`'s). A backend whose rows come from several kernels returns them apart, so
        that a consumer that copies its input anyway (the W8A8 o_proj quantizes it) reads each
        where it lies instead of a stacked copy. Here: one piece."""
        return [self.attend(layer_index, q, k, v, scale, qk_norm_rope)]


class ContiguousKVCache(AttentionBackend):
    """Unpaged per-sequence KV cache. Call `plan` before each model forward."""

    def __init__(self, num_layers: int) -> None:
        self._keys: list[dict[Hashable, torch.Tensor]] = [{} for _ in range(num_layers)]
        self._values: list[dict[Hashable, torch.Tensor]] = [{} for _ in range(num_layers)]
        self._plan: list[tuple[Hashable, int]] = []

    def plan(self, sequence_ids: Sequence[Hashable], query_lens: Sequence[int]) -> None:
        """The next forward's flat batch holds `query_lens[i]` tokens of `sequence_ids[i]`, in order."""
        if len(sequence_ids) != len(query_lens) or len(set(sequence_ids)) != len(sequence_ids):
            raise ValueError("plan needs one query length per distinct sequence id")
        self._plan = list(zip(sequence_ids, query_lens))

    def cached_length(self, sequence_id: Hashable) -> int:
        cached = self._keys[0].get(sequence_id)
        return 0 if cached is None else cached.shape[0]

    def free(self, sequence_id: Hashable) -> None:
        for layer_keys, layer_values in zip(self._keys, self._values):
            layer_keys.pop(sequence_id, None)
            layer_values.pop(sequence_id, None)

    def attend(
        self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        qk_norm_rope: kernels.QKNormRope | None = None,
    ) -> torch.Tensor:
        if qk_norm_rope is not None:
            q, k = qk_norm_rope(q, k)
        if sum(length for _, length in self._plan) != q.shape[0]:
            raise ValueError(f"the planned query lengths do not add up to the {q.shape[0]} tokens given")
        outputs = []
        start = 0
        for sequence_id, query_len in self._plan:
            end = start + query_len
            keys = self._append(self._keys[layer_index], sequence_id, k[start:end])  # [S, Hkv, D]
            values = self._append(self._values[layer_index], sequence_id, v[start:end])
            outputs.append(causal_attention(q[start:end], keys, values, scale))
            start = end
        return torch.cat(outputs, dim=0)

    @staticmethod
    def _append(store: dict[Hashable, torch.Tensor], sequence_id: Hashable, new: torch.Tensor) -> torch.Tensor:
        previous = store.get(sequence_id)
        store[sequence_id] = new if previous is None else torch.cat([previous, new], dim=0)
        return store[sequence_id]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The last q.shape[0] positions of one sequence attending causally to all k/v.

    q [L, Hq, D]; k, v [S, Hkv, D] with S >= L; returns [L, Hq, D].
    """
    query_len, kv_len = q.shape[0], k.shape[0]
    # query i sits at position kv_len - query_len + i and sees keys 0..that position
    query_positions = torch.arange(kv_len - query_len, kv_len, device=q.device)
    mask = torch.arange(kv_len, device=q.device)[None, :] <= query_positions[:, None]  # [L, S]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),  # [Hq, L, D]
        k.transpose(0, 1),  # [Hkv, S, D]
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)  # [L, Hq, D]
