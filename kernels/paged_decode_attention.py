"""Decode attention over the paged KV cache: one query token per sequence.

Sequence b's query attends to its first ``context_lens[b]`` cached tokens (the
current token's K/V already written). GQA: query head h reads KV head
``h // (Hq // Hkv)``. Scores and softmax in float32. A sequence with
``context_lens[b] == 0`` (batch padding) gets a zero output.

`paged_decode_attention_with_kv_write` also writes the current token's K/V into
the cache in the same launch (see `kernels/jit/paged_decode_attention.py` for
why that is race-free for decode; prefill must not do this, see
`kernels/paged_prefill_attention.py`).
"""

from __future__ import annotations

import torch

from kernels.attention_common import LOG2_E, dot_precision, multiprocessor_count
from kernels.checks import (
    INDEX_DTYPES,
    check_dtype,
    check_same_device,
    check_shape,
    check_unit_stride_last_dim,
)
from kernels.dispatch import use_triton
from kernels.kv_cache import (
    check_paged_kv_cache,
    check_reshape_and_cache_args,
    reshape_and_cache_reference,
)

MAX_SPLITS = 64  # the reduce kernel holds all splits of one head in registers
MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost outweighs the parallelism


# --------------------------------------------------------------------------- reference
def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D]; float32 scores/softmax, all sequences in one batched pass.

    The blocks of every sequence are gathered once into [B, S, Hkv*D] (S = the
    longest context). Scores and outputs are two batched matmuls against a
    block-diagonal query ([Hkv*D, Hkv*G], head h's queries in block h), which
    needs no permuted copy of K or V; positions past a sequence's length are
    masked out of its softmax.
    """
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    lengths = context_lens.long()
    max_len = int(lengths.max()) if batch else 0
    if max_len == 0:
        return torch.zeros_like(q)
    num_blocks = -(-max_len // block_size)
    # unused table entries may hold anything; their positions are masked below
    blocks = block_tables[:, :num_blocks].reshape(-1).long().clamp(0, k_cache.shape[0] - 1)  # [B * nb]

    def gather(cache: torch.Tensor) -> torch.Tensor:
        rows = cache.reshape(cache.shape[0], -1).index_select(0, blocks)  # [B * nb, bs * Hkv * D]
        return rows.view(batch, num_blocks * block_size, num_kv_heads * head_dim).float()  # [B, S', Hkv*D]

    keys, values = gather(k_cache), gather(v_cache)
    # slots past a sequence's length hold anything (even NaN): zero them so 0 * garbage stays 0
    for seq, length in enumerate(lengths.tolist()):
        if length < values.shape[1]:
            values[seq, length:] = 0.0
    query = q.float().view(batch, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
    block_query = query.new_zeros(batch, num_kv_heads, head_dim, num_kv_heads, group)  # [B, Hkv, D, Hkv, G]
    for head in range(num_kv_heads):
        block_query[:, head, :, head, :] = query[:, head].transpose(1, 2)  # [B, D, G]
    scores = torch.bmm(keys, block_query.view(batch, num_kv_heads * head_dim, num_q_heads)) * scale  # [B, S', Hq]
    valid = torch.arange(keys.shape[1], device=q.device)[None, :] < lengths[:, None]  # [B, S']
    scores.masked_fill_(~valid[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=1).nan_to_num_(0.0)  # over positions; empty sequences -> zeros
    mixed = torch.bmm(probs.transpose(1, 2), values)  # [B, Hq, S'] @ [B, S', Hkv*D] -> [B, Hq, Hkv*D]
    mixed = mixed.view(batch, num_kv_heads, group, num_kv_heads, head_dim)  # [B, Hkv, G, Hkv, D]
    heads = torch.arange(num_kv_heads, device=q.device)
    context = mixed[:, heads, :, heads, :]  # each query head's own KV head: [Hkv, B, G, D]
    return context.permute(1, 0, 2, 3).reshape(batch, num_q_heads, head_dim).to(q.dtype)  # [B, Hq, D]


def paged_decode_attention_with_kv_write_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    reshape_and_cache_reference(k, v, k_cache, v_cache, slot_mapping)
    return paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)


# --------------------------------------------------------------------------- triton
def _check_decode_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    _, _, num_kv_heads, head_dim = check_paged_kv_cache(k_cache, v_cache)
    check_shape("q", q, (None, None, head_dim))
    batch, num_q_heads, _ = q.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"q: {num_q_heads} query heads is not a multiple of the cache's {num_kv_heads} KV heads"
        )
    check_dtype("q", q, (k_cache.dtype,))
    check_unit_stride_last_dim("q", q)
    check_shape("block_tables", block_tables, (batch, None))
    check_shape("context_lens", context_lens, (batch,))
    check_dtype("block_tables", block_tables, INDEX_DTYPES)
    check_dtype("context_lens", context_lens, INDEX_DTYPES)
    check_unit_stride_last_dim("block_tables", block_tables)
    check_same_device(q=q, k_cache=k_cache, block_tables=block_tables, context_lens=context_lens)


def choose_num_splits(num_programs: int, max_context_len: int, device: torch.device) -> int:
    """Enough (sequence, KV head, split) programs to fill the GPU about twice over,
    without splits shorter than MIN_TOKENS_PER_SPLIT."""
    wanted = -(-2 * multiprocessor_count(device) // max(num_programs, 1))
    longest_useful = max(1, max_context_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, longest_useful, MAX_SPLITS))


def _launch_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None,
    num_splits: int | None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    import triton

    from kernels.jit.paged_decode_attention import (
        paged_decode_reduce_kernel,
        paged_decode_split_kernel,
    )

    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    queries_per_kv = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out

    block_n = 64 if head_dim <= 128 else 32
    if max_context_len is None:  # an upper bound known without a device sync
        max_context_len = block_tables.shape[1] * block_size
    max_context_len = max(max_context_len, 1)
    if num_splits is None:
        num_splits = choose_num_splits(batch * num_kv_heads, max_context_len, q.device)
    num_splits = max(1, min(num_splits, MAX_SPLITS))
    tokens_per_split = triton.cdiv(triton.cdiv(max_context_len, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_context_len, tokens_per_split)

    partial_out = torch.empty(
        (batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
    )
    partial_max = torch.empty(
        (batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device
    )
    partial_sum = torch.empty_like(partial_max)
    if new_kv is None:  # placeholders, never read when FUSE_CACHE_WRITE is False
        new_k = new_v = q
        slot_mapping = context_lens
    else:
        new_k, new_v, slot_mapping = new_kv

    block_d = triton.next_power_of_2(head_dim)
    paged_decode_split_kernel[(batch, num_kv_heads, num_splits)](
        # pointers
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        partial_out,
        partial_max,
        partial_sum,
        new_k,
        new_v,
        slot_mapping,
        # sizes
        scale * LOG2_E,
        block_size,
        tokens_per_split,
        queries_per_kv,
        # strides
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_max.stride(0),
        partial_max.stride(1),
        new_k.stride(0),
        new_k.stride(1),
        new_v.stride(0),
        new_v.stride(1),
        # meta-parameters
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_G=max(16, triton.next_power_of_2(queries_per_kv)),
        BLOCK_N=block_n,
        FUSE_CACHE_WRITE=new_kv is not None,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4,
        num_stages=2,
    )
    paged_decode_reduce_kernel[(batch, num_q_heads)](
        # pointers
        partial_out,
        partial_max,
        partial_sum,
        context_lens,
        out,
        # sizes
        tokens_per_split,
        # strides
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_max.stride(0),
        partial_max.stride(1),
        out.stride(0),
        out.stride(1),
        # meta-parameters
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SPLITS=triton.next_power_of_2(num_splits),
        num_warps=4,
    )
    return out


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_context_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """`max_context_len`: optional host-side upper bound of context_lens (sizes the KV
    split without a device sync); `num_splits`: override the split heuristic."""
    _check_decode_args(q, k_cache, v_cache, block_tables, context_lens)
    return _launch_decode(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale,
        max_context_len,
        num_splits,
        new_kv=None,
    )


def paged_decode_attention_with_kv_write_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_context_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    _check_decode_args(q, k_cache, v_cache, block_tables, context_lens)
    check_reshape_and_cache_args(k, v, k_cache, v_cache, slot_mapping)
    check_shape("k", k, (q.shape[0], None, None))
    check_same_device(q=q, k=k)
    return _launch_decode(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale,
        max_context_len,
        num_splits,
        new_kv=(k, v, slot_mapping),
    )


# --------------------------------------------------------------------------- dispatch
def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, D], caches [N, bs, Hkv, D], block_tables [B, max_blocks], context_lens [B]
    -> [B, Hq, D]."""
    if use_triton(q, k_cache, v_cache, block_tables, context_lens):
        return paged_decode_attention_triton(
            q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len=max_context_len
        )
    return paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_decode_attention_with_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """`reshape_and_cache(k, v, ...)` + `paged_decode_attention(q, ...)` in one launch.

    k, v [B, Hkv, D] are the current tokens' K/V; `slot_mapping[b]` must be the slot of
    position ``context_lens[b] - 1`` (or negative for padding, which must also have
    ``context_lens[b] == 0``: the fused kernel writes only for sequences it attends)."""
    if use_triton(q, k, v, k_cache, v_cache, slot_mapping, block_tables, context_lens):
        return paged_decode_attention_with_kv_write_triton(
            q,
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            block_tables,
            context_lens,
            scale,
            max_context_len=max_context_len,
        )
    return paged_decode_attention_with_kv_write_reference(
        q, k, v, k_cache, v_cache, slot_mapping, block_tables, context_lens, scale
    )
