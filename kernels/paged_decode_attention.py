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

from kernels.arrival_counters import arrival_counters
from kernels.attention_common import LOG2_E, dot_precision, float16_dots, multiprocessor_count
from kernels.checks import (
    INDEX_DTYPES,
    check_dtype,
    check_same_device,
    check_shape,
    check_unit_stride_last_dim,
)
from kernels.dispatch import kernels_off, use_triton, widens_with_ptx
from kernels.fp8 import FP8_DTYPE
from kernels.kv_cache import (
    check_paged_kv_cache,
    check_query_matches_cache,
    check_reshape_and_cache_args,
    reshape_and_cache_reference,
)
from kernels.launch_math import next_power_of_2
from kernels.paged_decode_configs import (
    MIN_TOKENS_PER_SPLIT,
    PROGRAMS_PER_SM,
    DecodeKernelConfig,
    get_decode_config,
)
from kernels.pdl import launch_options
from kernels.rotary import QKNormRope, check_qk_norm_mrope_args

MAX_SPLITS = 64  # the reduce kernel holds all splits of one head in registers
MERGE_TILE = 2048  # float32 partials the merging program holds per step: [queries per KV head, splits, D]


# --------------------------------------------------------------------------- reference
# gathered K+V per group of sequences: big enough to amortise the per-group ops, small enough to
# stay in the CPU cache. Offline benchmark, batch 256, 2-core EPYC: 4 MiB 23 ms, 8 MiB 20 ms,
# 16 MiB 15 ms, 32 MiB 17 ms per decode attention call.
GATHER_BYTES_PER_GROUP = 16 * 2**20
MIN_SHARED_BLOCKS = 2  # a shared prefix shorter than this is gathered per sequence as usual


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D]; float32 scores/softmax. See `paged_attention_rows`."""
    return paged_attention_rows(q[:, None], k_cache, v_cache, block_tables, context_lens[:, None], scale)[:, 0]


def paged_attention_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, Q, Hq, D] -> [B, Q, Hq, D]: query j of sequence b attends to the first
    ``lengths[b, j]`` cached tokens of its block table (0: a padding query, zero output).

    Decode is Q = 1; a short extend (a few tokens after a long cached context,
    such as a jump-forward span) is Q = its length with lengths growing by one.
    Float32 scores and softmax. Two CPU optimisations, same softmax over the
    same positions:
    - sequences are clustered by their first block; the leading blocks a
      cluster shares (a prompt prefix reused through the prefix cache, such as
      this workload's system prompt) are gathered once for the cluster instead
      of once per sequence;
    - the rest is processed in groups of sequences whose gathered K and V
      (about GATHER_BYTES_PER_GROUP) stay in the CPU cache between the gather
      and the matmuls that read them.
    """
    batch = q.shape[0]
    lengths = lengths.long()
    if batch == 0 or int(lengths.max()) == 0:
        return torch.zeros_like(q)
    # sequences that start with the same block may share a prefix: handle them together;
    # sequences alone with their first block share nothing and go together in one pass
    first_blocks, cluster, sizes = torch.unique(block_tables[:, 0], return_inverse=True, return_counts=True)
    if len(first_blocks) == 1:
        return _attend_with_shared_prefix(q, k_cache, v_cache, block_tables, lengths, scale)
    alone = sizes[cluster] == 1  # [B]
    row_sets = [alone.nonzero().flatten()] if bool(alone.any()) else []
    row_sets += [(cluster == index).nonzero().flatten() for index in (sizes > 1).nonzero().flatten().tolist()]
    out = torch.empty_like(q)
    for rows in row_sets:
        out[rows] = _attend_with_shared_prefix(q[rows], k_cache, v_cache, block_tables[rows], lengths[rows], scale)
    return out


def _attend_with_shared_prefix(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Sequences whose common leading blocks are gathered once, the rest in cache-sized groups.

    Queries are laid out block-diagonally ([B, Q*Hq, Hkv*D]: query head h only
    has entries in its KV head's D columns), so scores against all KV heads at
    once are plain matmuls with no permuted copy of K or V. The softmax over
    [shared prefix | own positions] is taken in two parts that share one
    running maximum: the prefix part is one GEMM for all sequences, the own
    parts are batched matmuls per group, and the two are added before the
    single normalisation.
    """
    batch, num_queries, num_q_heads, head_dim = q.shape
    max_len = int(lengths.max())
    if max_len == 0:
        return torch.zeros_like(q)
    _, block_size, num_kv_heads, _ = k_cache.shape
    group_size = num_q_heads // num_kv_heads
    width = num_kv_heads * head_dim
    rows = num_queries * num_q_heads  # score rows per sequence
    queries = q.new_zeros(batch, num_queries, num_q_heads, width, dtype=torch.float32)  # [B, Q, Hq, Hkv*D]
    for head in range(num_kv_heads):
        heads, columns = slice(head * group_size, (head + 1) * group_size), slice(head * head_dim, (head + 1) * head_dim)
        queries[:, :, heads, columns] = q[:, :, heads].float() * scale
    queries = queries.view(batch, rows, width)  # [B, Q*Hq, Hkv*D]

    real = lengths > 0  # [B, Q]; padding queries are zeroed at the end
    shortest = int(lengths[real].min())
    shared = _shared_leading_blocks(block_tables, shortest, block_size)
    if shared < MIN_SHARED_BLOCKS:
        shared = 0
    running_max = torch.full((batch, rows), float("-inf"), device=q.device)  # [B, Q*Hq]
    prefix_scores = prefix_values = None
    if shared:
        prefix_keys, prefix_values = (
            _gather_blocks(cache, block_tables[0, :shared].long()).view(shared * block_size, width).float()
            for cache in (k_cache, v_cache)
        )  # K, V [P, Hkv*D]
        prefix_scores = (queries.view(-1, width) @ prefix_keys.t()).view(batch, rows, -1)  # [B, Q*Hq, P]
        running_max = prefix_scores.amax(dim=2)

    # own parts: exp(scores - max) @ V, unnormalised, group by group
    weighted = torch.zeros(batch, rows, width, device=q.device)  # [B, Q*Hq, Hkv*D]
    weight_sums = torch.zeros(batch, rows, device=q.device)  # [B, Q*Hq]
    own_lengths = lengths - shared * block_size  # [B, Q]; <= 0: nothing of its own
    per_sequence = 2 * (max_len - shared * block_size) * width * 4  # float32 K and V
    group = max(1, GATHER_BYTES_PER_GROUP // max(per_sequence, 1))
    for first in range(0, batch if max_len > shared * block_size else 0, group):
        part = slice(first, first + group)
        _own_part(queries[part], k_cache, v_cache, block_tables[part, shared:], own_lengths[part],
                  running_max[part], weighted[part], weight_sums[part])
    if prefix_scores is not None:
        finite_max = torch.where(torch.isinf(running_max), 0.0, running_max)  # all-masked rows stay zero
        prefix_probs = (prefix_scores - finite_max[:, :, None]).exp_()  # [B, Q*Hq, P]
        weight_sums += prefix_probs.sum(dim=2)
        weighted += (prefix_probs.view(-1, prefix_probs.shape[2]) @ prefix_values).view(batch, rows, width)
    mixed = weighted / weight_sums.clamp_min(torch.finfo(torch.float32).tiny)[:, :, None]  # empty rows -> 0
    # each query head keeps the D columns of its own KV head
    per_head = mixed.view(batch, num_queries, num_kv_heads, group_size, num_kv_heads, head_dim)  # [B, Q, Hkv, G, Hkv, D]
    context = per_head.diagonal(dim1=2, dim2=4)  # [B, Q, G, D, Hkv]
    out = context.permute(0, 1, 4, 2, 3).reshape(batch, num_queries, num_q_heads, head_dim)  # [B, Q, Hq, D]
    return out.masked_fill_(~real[:, :, None, None], 0.0).to(q.dtype)


def _shared_leading_blocks(block_tables: torch.Tensor, shortest: int, block_size: int) -> int:
    """How many leading blocks every sequence has in common (full blocks of the shortest context)."""
    if block_tables.shape[0] < 2:
        return 0
    limit = min(shortest // block_size, block_tables.shape[1])
    same = (block_tables[:, :limit] == block_tables[:1, :limit]).all(dim=0)  # [limit]
    return limit if bool(same.all()) else int(same.long().argmin())


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Rows [len(blocks), block_size * Hkv * D] of the given blocks (either memory layout of the
    pool: the blocks are picked first, so a head-major pool is not copied whole)."""
    return cache.index_select(0, blocks).reshape(blocks.shape[0], -1)  # [nb, bs, Hkv, D] -> [nb, bs*Hkv*D]


def _own_part(
    queries: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    running_max: torch.Tensor,
    weighted: torch.Tensor,
    weight_sums: torch.Tensor,
) -> None:
    """One group's own positions, gathered once into [B, S, Hkv*D] (sized to stay in the CPU cache).

    `queries` [B, Q*Hq, Hkv*D], `lengths` [B, Q] (own positions each query
    sees). In place: `running_max` [B, Q*Hq] becomes the max over prefix and
    own scores; `weighted` [B, Q*Hq, Hkv*D] and `weight_sums` [B, Q*Hq] get
    the own part's exp(score - max) @ V and sum of exp(score - max), with the
    prefix part's rescaled (it is added later, against the final max).
    """
    batch, rows, width = queries.shape
    num_queries = lengths.shape[1]
    block_size = k_cache.shape[1]
    sequence_lengths = lengths.amax(dim=1)  # [B]: the longest query's view of each sequence
    num_blocks = -(-int(sequence_lengths.max()) // block_size)
    if num_blocks <= 0:  # the group's contexts end with the shared prefix
        return
    # unused table entries may hold anything; their positions are masked below
    blocks = block_tables[:, :num_blocks].reshape(-1).long().clamp(0, k_cache.shape[0] - 1)  # [B * nb]
    keys = _gather_blocks(k_cache, blocks).view(batch, num_blocks * block_size, width).float()  # [B, S, Hkv*D]
    values = _gather_blocks(v_cache, blocks).view(batch, num_blocks * block_size, width).float()
    positions = torch.arange(keys.shape[1], device=queries.device)
    # slots past a sequence's length hold anything (even NaN): zero them so 0 * garbage stays 0
    invalid_rows = (positions[None, :] >= sequence_lengths[:, None]).flatten().nonzero().flatten()  # few
    values.view(-1, width).index_fill_(0, invalid_rows, 0.0)  # [B*S, Hkv*D]
    scores = torch.bmm(queries, keys.transpose(1, 2))  # [B, Q*Hq, S]
    visible = positions[None, None, :] < lengths[:, :, None]  # [B, Q, S]
    scores.view(batch, num_queries, rows // num_queries, -1).masked_fill_(~visible[:, :, None, :], float("-inf"))
    torch.maximum(running_max, scores.amax(dim=2), out=running_max)
    finite_max = torch.where(torch.isinf(running_max), 0.0, running_max)  # all-masked rows stay zero
    probs = scores.sub_(finite_max[:, :, None]).exp_()  # [B, Q*Hq, S]
    weight_sums += probs.sum(dim=2)
    weighted += torch.bmm(probs, values)  # [B, Q*Hq, S] @ [B, S, Hkv*D] -> [B, Q*Hq, Hkv*D]


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
    check_query_matches_cache(q, k_cache)
    check_unit_stride_last_dim("q", q)
    check_shape("block_tables", block_tables, (batch, None))
    check_shape("context_lens", context_lens, (batch,))
    check_dtype("block_tables", block_tables, INDEX_DTYPES)
    check_dtype("context_lens", context_lens, INDEX_DTYPES)
    check_unit_stride_last_dim("block_tables", block_tables)
    check_same_device(q=q, k_cache=k_cache, block_tables=block_tables, context_lens=context_lens)


def choose_num_splits(
    num_programs: int,
    max_context_len: int,
    device: torch.device,
    programs_per_sm: int = PROGRAMS_PER_SM,
    min_split_tokens: int = MIN_TOKENS_PER_SPLIT,
) -> int:
    """Enough (sequence, KV head, split) programs to fill the GPU `programs_per_sm` times over,
    without splits shorter than `min_split_tokens`."""
    wanted = -(-programs_per_sm * multiprocessor_count(device) // max(num_programs, 1))
    longest_useful = max(1, max_context_len // min_split_tokens)
    return max(1, min(wanted, longest_useful, MAX_SPLITS))


def reads_fp8_words(v_cache: torch.Tensor) -> bool:
    """Whether the decode kernel may read an FP8 V cache as 4-byte words (rows and strides
    aligned to 4 bytes), to widen it in the layout it was loaded in."""
    return v_cache.data_ptr() % 4 == 0 and v_cache.shape[-1] % 4 == 0 and v_cache.stride(-1) == 1 and all(
        stride % 4 == 0 for stride in v_cache.stride()[:-1])


def loads_block_ids_ahead(config: DecodeKernelConfig) -> bool:
    """Whether the split kernel loads each tile's cache blocks one iteration before the tile's K/V
    (IDS_AHEAD, jit/paged_decode_attention.py): where the config asks for 3 or more pipeline
    stages, unless VLM_CATALOG_KERNELS_OFF names `decode_ids_ahead`.

    Loaded in the same iteration, the block ids make the K/V loads indirect, and Triton's
    pipeliner (3.6 and 3.9) then keeps one tile in flight whatever the stages: in the sm_90
    SASS every iteration begins by waiting for all outstanding copies (``DEPBAR.LE SB0, 0x0``),
    issued late in the iteration before. Ahead, 3 stages keep one more tile in flight and 4
    two more (``0x2``, ``0x4``). At 2 stages it would change nothing but the registers (116 to
    146 at 64 positions a tile), so those configs keep the loop they were tuned with."""
    return config.num_stages >= 3 and "decode_ids_ahead" not in kernels_off()


MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension


def launches_heads_together(batch: int) -> bool:
    """Whether the split kernel's grid is (KV head, sequence, split) (HEADS_TOGETHER,
    jit/paged_decode_attention.py), so that a sequence's KV heads run side by side and read each
    cache block's interleaved rows at about the same time, unless VLM_CATALOG_KERNELS_OFF names
    `decode_heads_together` or the batch passes CUDA's limit on the grid's second dimension.
    Every sequence's head 0 launched before any head 1 before; the output is the same."""
    return batch <= MAX_GRID_Y and "decode_heads_together" not in kernels_off()


def split_plan(
    batch: int,
    num_kv_heads: int,
    max_context_len: int,
    device: torch.device,
    config: DecodeKernelConfig,
    num_splits: int | None = None,
) -> tuple[int, int]:
    """(splits in the grid, the shortest split in tokens) of a launch. Each sequence shares its own
    length over the splits (jit/paged_decode_attention.py, split_length); splits the heuristic
    chooses are at least the config's min_split_tokens long, an override's (`num_splits`) as short
    as one tile."""
    block_n = config.block_n
    min_split_tokens = block_n
    if num_splits is None:
        num_splits = choose_num_splits(batch * num_kv_heads, max_context_len, device, config.programs_per_sm,
                                       config.min_split_tokens)
        min_split_tokens = -(-config.min_split_tokens // block_n) * block_n
    return max(1, min(num_splits, MAX_SPLITS, -(-max_context_len // block_n))), min_split_tokens


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
    config: DecodeKernelConfig | None = None,
    qk_norm_rope: QKNormRope | None = None,
) -> torch.Tensor:
    """`qk_norm_rope` (with `new_kv` only): q and the new k are raw, and the split kernel norms and
    rotates them itself (NORM_ROPE), checked as `qk_norm_mrope` checks them."""
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

    config = config or get_decode_config(k_cache.dtype, head_dim, batch, q.device)
    block_n = config.block_n
    if max_context_len is None:  # an upper bound known without a device sync
        max_context_len = block_tables.shape[1] * block_size
    max_context_len = max(max_context_len, 1)
    num_splits, min_split_tokens = split_plan(batch, num_kv_heads, max_context_len, q.device, config, num_splits)

    single_split = num_splits == 1  # the split kernel writes `out` itself: no partials, no reduce launch
    # several splits: each pair's last split to finish merges them, with no reduce launch
    counters = None
    if not single_split and "decode_merge_in_place" not in kernels_off():
        counters = arrival_counters(q.device, batch * num_kv_heads)  # one per (sequence, KV head)
    merge_in_place = counters is not None
    if single_split:  # placeholders, never touched
        partial_out = partial_max = partial_sum = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device)
    else:
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
    norm = qk_norm_rope
    if norm is not None:
        if new_kv is None:
            raise ValueError("qk_norm_rope needs the new k (the fused cache write): it norms and rotates it too")
        positions = check_qk_norm_mrope_args(q, new_k, norm)
        if not norm.keeps_dtypes(q, new_k):
            raise ValueError(f"qk_norm_rope: weights of {norm.q_weight.dtype} would promote q/k of {q.dtype}")
        norm_args = (norm.q_weight, norm.k_weight, positions, norm.inv_freq)
        sections, eps = tuple(norm.mrope_section), norm.eps
    else:  # placeholders, never read when NORM_ROPE is False
        positions = context_lens[None, :]
        norm_args, sections, eps = (q, q, positions, q), (0, 0, 0), 0.0

    block_d = next_power_of_2(head_dim)
    block_merge_g = next_power_of_2(queries_per_kv)
    merge_splits = max(1, min(next_power_of_2(num_splits), MERGE_TILE // (block_merge_g * block_d)))
    fp16_dots = float16_dots(q.dtype, k_cache.dtype) and reads_fp8_words(v_cache)
    v_words = fp16_dots and "fp8_v_words" not in kernels_off()  # off: V read as bytes, cast to float16
    heads_together = launches_heads_together(batch)
    grid = (num_kv_heads, batch, num_splits) if heads_together else (batch, num_kv_heads, num_splits)
    paged_decode_split_kernel[grid](
        # pointers
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        partial_out,
        partial_max,
        partial_sum,
        out,
        new_k,
        new_v,
        slot_mapping,
        *norm_args,
        counters if merge_in_place else context_lens,  # a placeholder, never touched without the merge
        # sizes
        scale * LOG2_E,
        min_split_tokens,
        queries_per_kv,
        eps,
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
        out.stride(0),
        out.stride(1),
        new_k.stride(0),
        new_k.stride(1),
        new_v.stride(0),
        new_v.stride(1),
        positions.stride(0),
        positions.stride(1),
        # meta-parameters
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_G=max(16, next_power_of_2(queries_per_kv)),
        BLOCK_N=block_n,
        FUSE_CACHE_WRITE=new_kv is not None,
        SATURATE_FP8=k_cache.dtype == FP8_DTYPE,
        DOT_PRECISION=dot_precision(q.dtype),
        SINGLE_SPLIT=single_split,
        FP16_DOTS=fp16_dots,
        V_WORDS=v_words,
        WIDEN_WITH_PTX=v_words and widens_with_ptx(paged_decode_split_kernel),
        NORM_ROPE=norm is not None,
        SECTION_H=sections[1],
        SECTION_W=sections[2],
        MERGE_IN_PLACE=merge_in_place,
        BLOCK_MERGE_G=block_merge_g,
        MERGE_SPLITS=merge_splits,
        IDS_AHEAD=loads_block_ids_ahead(config),
        HEADS_TOGETHER=heads_together,
        **config.launch_options(),
        **launch_options(q),
    )
    if single_split or merge_in_place:
        return out
    paged_decode_reduce_kernel[(batch, num_q_heads)](
        # pointers
        partial_out,
        partial_max,
        partial_sum,
        context_lens,
        out,
        # sizes
        num_splits,
        min_split_tokens,
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
        BLOCK_SPLITS=next_power_of_2(num_splits),
        BLOCK_N=block_n,
        num_warps=4,
        **launch_options(partial_out),
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
    config: DecodeKernelConfig | None = None,
) -> torch.Tensor:
    """`max_context_len`: optional host-side upper bound of context_lens (sizes the KV
    split without a device sync); `num_splits`: override the split heuristic; `config`:
    override the table's launch settings (kernels/paged_decode_configs.py)."""
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
        config=config,
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
    config: DecodeKernelConfig | None = None,
    qk_norm_rope: QKNormRope | None = None,
) -> torch.Tensor:
    """`qk_norm_rope`: q and k are raw; the kernel norms and rotates them as `qk_norm_mrope`
    would, in the same launch."""
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
        config=config,
        qk_norm_rope=qk_norm_rope,
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
    if use_triton(q, k_cache, v_cache, block_tables, context_lens, op="paged_decode_attention"):
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
    qk_norm_rope: QKNormRope | None = None,
) -> torch.Tensor:
    """`reshape_and_cache(k, v, ...)` + `paged_decode_attention(q, ...)` in one launch.

    k, v [B, Hkv, D] are the current tokens' K/V; `slot_mapping[b]` must be the slot of
    position ``context_lens[b] - 1`` (or negative for padding, which must also have
    ``context_lens[b] == 0``: the fused kernel writes only for sequences it attends).
    `qk_norm_rope`: q and k arrive raw and are normed and rotated first (`qk_norm_mrope`); the
    Triton kernel does that in the same launch (`decode_qk_norm_rope` in VLM_CATALOG_KERNELS_OFF:
    qk_norm_mrope's own launch first)."""
    triton_path = use_triton(q, k, v, k_cache, v_cache, slot_mapping, block_tables, context_lens,
                             op="paged_decode_attention_with_kv_write")
    if qk_norm_rope is not None and not (triton_path and fuses_qk_norm_rope(qk_norm_rope, q, k)):
        q, k = qk_norm_rope(q, k)
        qk_norm_rope = None
    if triton_path:
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
            qk_norm_rope=qk_norm_rope,
        )
    return paged_decode_attention_with_kv_write_reference(
        q, k, v, k_cache, v_cache, slot_mapping, block_tables, context_lens, scale
    )


def fuses_qk_norm_rope(qk_norm_rope: QKNormRope, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the Triton decode kernel norms and rotates q and k itself: unless
    VLM_CATALOG_KERNELS_OFF names ``decode_qk_norm_rope`` or ``qk_norm_mrope`` (which must then
    run its reference), and where the outputs keep q's and k's dtypes."""
    off = kernels_off()
    return "decode_qk_norm_rope" not in off and "qk_norm_mrope" not in off and qk_norm_rope.keeps_dtypes(q, k)
