"""The engine's attention backend: attention over the paged KV cache.

Per layer, `k_cache` and `v_cache` are `[num_blocks, block_size, Hkv, D]`.
A step's layout (`PagedAttentionMetadata`) says where each new token's K/V
goes (`slot_mapping`) and which blocks each sequence reads (`block_tables`).
Steps where every sequence computes exactly one token use the decode kernel
(with the cache write fused in); any other step uses the varlen prefill
kernel, which also covers decodes mixed into a batch of prefill chunks.
On CPU both are the torch references from `kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from vlm_catalog.model.attention import AttentionBackend


@dataclass
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32 (padded with 0)
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: query token offsets per sequence
    context_lens: torch.Tensor  # [B] int32: tokens in the cache per sequence after this step
    max_query_len: int
    max_context_len: int

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


class PagedAttention(AttentionBackend):
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: PagedAttentionMetadata) -> None:
        self.kv_caches = kv_caches
        self.metadata = metadata

    def attend(
        self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer_index]
        meta = self.metadata
        if meta.decode_only:
            return kernels.paged_decode_attention_with_kv_write(
                q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_tables, meta.context_lens, scale
            )
        kernels.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        return kernels.paged_prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens, scale,
            max_query_len=meta.max_query_len,
        )


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def allocate_kv_caches(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One preallocated K and V pool per layer: [num_blocks, block_size, Hkv, D]."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]
