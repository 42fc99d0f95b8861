"""The engine's attention backend: attention over the paged KV cache.

Per layer, `k_cache` and `v_cache` are `[num_blocks, block_size, Hkv, D]`.
A step's flat batch puts its decode sequences (one new token each) first and
its prefill chunks after; `PagedAttentionMetadata` describes both parts. The
decode part goes through the decode kernel (with the cache write fused in),
the prefill part through FlashAttention's varlen kernel on CUDA (or the varlen
prefill kernel; see kernels/paged_prefill_attention.py). On CPU both kernels
are the torch references from `kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from vlm_catalog.model.attention import AttentionBackend


@dataclass
class DecodeBatch:
    """The first `num_tokens` tokens of the step: one per sequence."""

    slot_mapping: torch.Tensor  # [Bd] int64
    block_tables: torch.Tensor  # [Bd, max_blocks] int32
    context_lens: torch.Tensor  # [Bd] int32, including the new token
    max_context_len: int

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


@dataclass
class PrefillBatch:
    """The remaining tokens: chunks of one or more tokens per sequence."""

    slot_mapping: torch.Tensor  # [Tp] int64
    block_tables: torch.Tensor  # [Bp, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [Bp + 1] int32, offsets within the prefill part
    context_lens: torch.Tensor  # [Bp] int32, cached tokens after this step
    max_query_len: int
    # the query lengths and context_lens on the host, to choose an attention backend per
    # sequence without a device sync (kernels/paged_prefill_attention.py); None: not known
    host_lens: tuple[list[int], list[int]] | None = None


@dataclass
class PagedAttentionMetadata:
    decode: DecodeBatch | None
    prefill: PrefillBatch | None


class PagedAttention(AttentionBackend):
    """One step's attention: build one per step (its prefill sequences' packed-context layout
    is computed once, on first use, and shared by every layer)."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: PagedAttentionMetadata) -> None:
        self.kv_caches = kv_caches
        self.metadata = metadata
        prefill = metadata.prefill
        self.prefill_contexts = (
            kernels.PackedContexts(prefill.block_tables, prefill.context_lens, prefill.host_lens[1])
            if prefill is not None and prefill.host_lens is not None else None
        )

    def attend(
        self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        qk_norm_rope: kernels.QKNormRope | None = None,
    ) -> torch.Tensor:
        outputs = self.attend_rows(layer_index, q, k, v, scale, qk_norm_rope)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def attend_rows(
        self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        qk_norm_rope: kernels.QKNormRope | None = None,
    ) -> list[torch.Tensor]:
        """The decode rows (first) in one fused launch, with `qk_norm_rope` applied inside it where
        the kernel can (one launch less per layer), then the prefill rows: one piece each."""
        k_cache, v_cache = self.kv_caches[layer_index]
        decode, prefill = self.metadata.decode, self.metadata.prefill
        outputs = []
        split = decode.num_tokens if decode is not None else 0
        if decode is not None:
            outputs.append(kernels.paged_decode_attention_with_kv_write(
                q[:split], k[:split], v[:split], k_cache, v_cache, decode.slot_mapping,
                decode.block_tables, decode.context_lens, scale, max_context_len=decode.max_context_len,
                qk_norm_rope=qk_norm_rope.rows(0, split) if qk_norm_rope is not None else None,
            ))
        if prefill is not None:
            q_rest, k_rest = q[split:], k[split:]
            if qk_norm_rope is not None:
                q_rest, k_rest = qk_norm_rope.rows(split, q.shape[0])(q_rest, k_rest)
            kernels.reshape_and_cache(k_rest, v[split:], k_cache, v_cache, prefill.slot_mapping)
            outputs.append(kernels.paged_prefill_attention(
                q_rest, k_cache, v_cache, prefill.block_tables, prefill.cu_seqlens_q,
                prefill.context_lens, scale, max_query_len=prefill.max_query_len,
                new_kv=(k_rest, v[split:]), host_lens=prefill.host_lens, contexts=self.prefill_contexts,
            ))
        return outputs


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def allocate_kv_caches(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One preallocated K and V pool per layer: [num_blocks, block_size, Hkv, D], in the memory
    layout `VLM_CATALOG_KV_LAYOUT` asks for (`kernels.kv_cache`: interleaved unless head_major)."""
    layout = kernels.kv_layout()
    return [
        tuple(kernels.zeros_paged_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, layout)
              for _ in range(2))
        for _ in range(num_layers)
    ]
