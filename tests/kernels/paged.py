"""Building paged KV caches from dense per-sequence K/V, and float64 dense attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedKV:
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 past each sequence's blocks
    context_lens: torch.Tensor  # [B] int32
    dense_k: list[torch.Tensor]  # per sequence [L, Hkv, D]: the truth the cache was built from
    dense_v: list[torch.Tensor]


def build_paged_kv(
    context_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    spare_blocks: int = 3,
) -> PagedKV:
    """Random K/V per sequence, scattered token by token into randomly ordered blocks of a
    cache whose unused slots hold NaN (a read of a wrong slot poisons the output)."""
    blocks_needed = [-(-length // block_size) for length in context_lens]
    num_blocks = sum(blocks_needed) + spare_blocks
    max_blocks = max(max(blocks_needed, default=1), 1) + 1
    k_cache = torch.full(
        (num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype
    )
    v_cache = k_cache.clone()
    block_tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
    free_blocks = torch.randperm(num_blocks).tolist()
    dense_k, dense_v = [], []
    for seq, length in enumerate(context_lens):
        keys = torch.randn(length, num_kv_heads, head_dim).to(dtype)
        values = torch.randn(length, num_kv_heads, head_dim).to(dtype)
        for page in range(blocks_needed[seq]):
            block_tables[seq, page] = free_blocks.pop()
        positions = torch.arange(length)
        blocks = block_tables[seq, positions // block_size].long()
        k_cache[blocks, positions % block_size] = keys  # token by token, via the block table
        v_cache[blocks, positions % block_size] = values
        dense_k.append(keys.to(device))
        dense_v.append(values.to(device))
    return PagedKV(
        k_cache.to(device),
        v_cache.to(device),
        block_tables.to(device),
        torch.tensor(context_lens, dtype=torch.int32, device=device),
        dense_k,
        dense_v,
    )


def dense_attention_float64(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    query_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [n, Hq, D], keys/values [L, Hkv, D] -> [n, Hq, D] in float64, GQA by head repetition;
    with `query_positions` [n], query i sees keys at positions <= query_positions[i]."""
    num_q_heads, num_kv_heads = q.shape[1], keys.shape[1]
    repeat = num_q_heads // num_kv_heads
    k64 = keys.double().repeat_interleave(repeat, dim=1)  # [L, Hq, D]
    v64 = values.double().repeat_interleave(repeat, dim=1)  # [L, Hq, D]
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k64) * scale  # [Hq, n, L]
    if query_positions is not None:
        hidden = torch.arange(keys.shape[0], device=q.device)[None, :] > query_positions[
            :, None
        ].to(q.device)
        scores = scores.masked_fill(hidden[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hnl,lhd->nhd", probs, v64)  # [n, Hq, D]
