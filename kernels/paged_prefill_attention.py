"""Varlen chunked prefill / extend attention over the paged KV cache.

Sequence b has ``q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b]`` new query tokens,
already written into the cache, and ``context_lens[b]`` cached tokens in total
(prefix + this chunk). Query j of sequence b sits at absolute position
``context_lens[b] - q_len + j`` and attends causally to cached positions <= its own.

No fused cache-write variant here, on purpose: a prefill program reads cache
blocks that *other* programs of the same launch would be writing (every query
tile of a sequence reads the whole chunk before the diagonal), and Triton has no
grid-wide barrier, so fusing the write would be a race. Write with
`reshape_and_cache` first (one cheap launch), then call this. Decode is different
(see `paged_decode_attention_with_kv_write`).

Backends on CUDA, when the caller passes the chunks' own k/v and the lengths on
the host (the engine does). First choice, for 16-bit queries with a head size
it takes: every chunk of the call in one causal FlashAttention varlen launch
(`kernels.flash_varlen`).
* When every chunk is fresh (nothing cached before it: a whole prompt, the
  usual prefill of the benchmark, which runs without prefix caching) and none
  reaches `SDPA_MIN_PREFILL_LEN` tokens, on the chunks' own k/v. A call with a
  longer fresh chunk goes per chunk instead (below).
* Otherwise (a prompt after a prefix-cache hit, the tail of a chunked prompt),
  on every sequence's whole context read out of the cache and packed
  (`PackedContexts`: one gather for K and one for V, at most `GATHER_MAX_KEYS`
  keys; the causal mask aligned bottom-right, which is checked once per device).
  Past that many keys, the fresh chunks take the varlen launch on their own k/v
  and the others one Triton launch that overwrites their rows.
Per chunk (without the varlen kernel, after it raised once, or for fresh calls
with a long chunk): fresh chunks of at least `SDPA_MIN_PREFILL_LEN` tokens run
causal SDPA each, and everything else goes through the Triton launch. Measured
on an H100 (bf16, 32 query heads of 128 over 4 KV heads, 2026-11-25,
docs/results/gpu/bench_gpu_2026-11-25.json, rows `paged_prefill_attention[fresh]`):
per-prompt SDPA against the varlen kernel / the Triton kernel is 0.11x / 0.10x
at 16 x 256 tokens, 0.31x / 0.28x at 8 x 512, 1.05x / 1.10x at 4 x 1024, 1.46x /
1.82x at 2 x 2048 and 1.69x / 2.29x at 1 x 8192: the threshold, 1024, is the
crossover.
With FlashAttention 3 as the varlen kernel (`VLM_CATALOG_FLASH_VARLEN=fa3`), fresh
chunks of every length take the varlen launch: the crossover above is FlashAttention 2's.
`VLM_CATALOG_PREFILL_ATTENTION` (``auto`` | ``flash`` | ``triton`` | ``sdpa``)
forces one backend for the fresh chunks; `VLM_CATALOG_KERNELS=triton` forces the kernel.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from kernels.attention_common import LOG2_E, dot_precision, float16_dots, forced_attention_backend
from kernels.checks import (
    INDEX_DTYPES,
    check_dtype,
    check_same_device,
    check_shape,
    check_unit_stride_last_dim,
)
from kernels.dispatch import kernel_backend, use_triton
from kernels.flash_varlen import (
    CAUSAL_WITH_CONTEXT,
    causal_with_context_supported,
    flash_takes_long_sequences,
    flash_varlen_usable,
    try_flash_varlen_attention,
)
from kernels.kv_cache import (
    PackedContexts,
    check_paged_kv_cache,
    check_query_matches_cache,
    gather_sequence_kv,
    to_cache_dtype,
)
from kernels.launch_math import cdiv, next_power_of_2
from kernels.paged_decode_attention import paged_attention_rows
from kernels.pdl import launch_options

PREFILL_BACKEND_ENV_VAR = "VLM_CATALOG_PREFILL_ATTENTION"
PREFILL_BACKENDS = ("flash", "triton", "sdpa")
SDPA_MIN_PREFILL_LEN = 1024  # from the H100 crossover, see the module docstring
NEVER = 2**31 - 1  # a chunk length no step reaches: the kernel skips nothing
GATHER_MAX_KEYS = 32768  # contexts packed for the varlen kernel: 64 MiB of K and V at 30B-A3B in bf16


# --------------------------------------------------------------------------- reference
def paged_prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D]; float32 softmax, bottom-right-aligned causal mask.

    Short chunks after a cached context (at most SHORT_EXTEND_QUERIES tokens:
    jump-forward spans, the tail of a chunked prompt) go together through the
    batched paged path of decode attention, which gathers each context once
    and shares the cached system prompt; per-sequence SDPA would gather every
    whole context separately. Longer chunks run SDPA per sequence.
    """
    out = torch.zeros_like(q)
    starts = cu_seqlens_q.tolist()
    context_list = context_lens.tolist()
    query_lens = [starts[seq + 1] - starts[seq] for seq in range(len(context_list))]
    short = [seq for seq, (n, length) in enumerate(zip(query_lens, context_list))
             if 0 < n <= SHORT_EXTEND_QUERIES and n < length]
    if short:
        _short_extends(q, k_cache, v_cache, block_tables, starts, query_lens, context_list, short, scale, out)
    short_set = set(short)
    for seq, context_len in enumerate(context_list):
        begin, end = starts[seq], starts[seq + 1]
        query_len = end - begin
        if query_len == 0 or seq in short_set:
            continue
        keys = gather_sequence_kv(k_cache, block_tables[seq], context_len).to(q.dtype)  # [L, Hkv, D]
        values = gather_sequence_kv(v_cache, block_tables[seq], context_len).to(q.dtype)  # [L, Hkv, D]
        if query_len == context_len:  # nothing cached before: plain causal attention (faster path)
            mask, causal = None, True
        else:
            mask, causal = _lower_right_causal_mask(query_len, context_len, q.dtype, q.device), False
        context = F.scaled_dot_product_attention(
            q[begin:end].transpose(0, 1).unsqueeze(0),  # [1, Hq, q_len, D]
            keys.transpose(0, 1).unsqueeze(0),  # [1, Hkv, L, D]
            values.transpose(0, 1).unsqueeze(0),  # [1, Hkv, L, D]
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=True,
        )  # [1, Hq, q_len, D]
        out[begin:end] = context[0].transpose(0, 1)  # [q_len, Hq, D]
    return out


SHORT_EXTEND_QUERIES = 16  # chunks up to this long after a cached context take the batched path


def _short_extends(q, k_cache, v_cache, block_tables, starts, query_lens, context_lens, short, scale, out) -> None:
    """The `short` sequences' chunks as rows of `paged_attention_rows`; results written into `out`."""
    width = max(query_lens[seq] for seq in short)
    token_index = torch.zeros(len(short), width, dtype=torch.long)  # [S, Q]: row of q for each query
    lengths = torch.zeros(len(short), width, dtype=torch.long)  # [S, Q]: 0 for padding queries
    for row, seq in enumerate(short):
        n, context_len = query_lens[seq], context_lens[seq]
        token_index[row, :n] = torch.arange(starts[seq], starts[seq] + n)
        lengths[row, :n] = torch.arange(context_len - n + 1, context_len + 1)  # query j sees up to itself
    token_index = token_index.to(q.device)
    queries = q[token_index.flatten()].view(len(short), width, *q.shape[1:])  # [S, Q, Hq, D]
    rows = torch.tensor(short, device=block_tables.device)
    attended = paged_attention_rows(queries, k_cache, v_cache, block_tables[rows], lengths.to(q.device), scale)
    real = lengths.flatten() > 0  # [S*Q]
    out[token_index.flatten()[real]] = attended.flatten(0, 1)[real]  # [S*Q, Hq, D] -> [T_short, Hq, D]


MAX_CACHED_MASK_SIDE = 4096  # the cached square mask stays at or under 64 MiB in float32
_causal_masks: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _lower_right_causal_mask(query_len: int, context_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [q_len, L]: query j (at position L - q_len + j) sees keys 0..L - q_len + j.

    A float mask, because SDPA's CPU kernel takes it ~15% faster than a boolean
    one. Building it for every sequence of every layer cost a fifth of the
    attention itself, so it is a view of one cached square causal mask
    (N x N, -inf above the diagonal): its bottom-right [q_len, L] corner is
    exactly this mask. Contexts longer than MAX_CACHED_MASK_SIDE get their own.
    """
    key = (dtype, device)
    side = _causal_masks[key].shape[0] if key in _causal_masks else 0
    if context_len > side:
        if context_len > MAX_CACHED_MASK_SIDE:
            query_positions = torch.arange(context_len - query_len, context_len, device=device)
            hidden = torch.arange(context_len, device=device)[None, :] > query_positions[:, None]  # [q_len, L]
            return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
        side = min(MAX_CACHED_MASK_SIDE, max(1024, 1 << (context_len - 1).bit_length()))
        _causal_masks[key] = torch.full((side, side), float("-inf"), dtype=dtype, device=device).triu_(1)
    return _causal_masks[key][side - query_len :, side - context_len :]  # [q_len, L], row stride `side`


# --------------------------------------------------------------------------- triton
def paged_prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    skip_fresh_from: int = NEVER,
) -> torch.Tensor:
    """`max_query_len`: optional host-side max of the per-sequence query lengths
    (otherwise computed here, which costs a device sync). `skip_fresh_from`: chunks with
    nothing cached before them and at least this many tokens are not computed (their
    output rows are left unwritten, for SDPA). Rows of q past `cu_seqlens_q[-1]` belong to no
    sequence: their output rows are left unwritten too (the reference gives zeros there)."""

    from kernels.jit.paged_prefill_attention import paged_prefill_attention_kernel

    _, block_size, num_kv_heads, head_dim = check_paged_kv_cache(k_cache, v_cache)
    check_shape("q", q, (None, None, head_dim))
    num_tokens, num_q_heads, _ = q.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"q: {num_q_heads} query heads is not a multiple of the cache's {num_kv_heads} KV heads"
        )
    check_shape("context_lens", context_lens, (None,))
    batch = context_lens.shape[0]
    check_shape("cu_seqlens_q", cu_seqlens_q, (batch + 1,))
    check_shape("block_tables", block_tables, (batch, None))
    check_query_matches_cache(q, k_cache)
    for name, tensor in (
        ("block_tables", block_tables),
        ("cu_seqlens_q", cu_seqlens_q),
        ("context_lens", context_lens),
    ):
        check_dtype(name, tensor, INDEX_DTYPES)
    check_unit_stride_last_dim("q", q)
    check_unit_stride_last_dim("block_tables", block_tables)
    check_same_device(
        q=q,
        k_cache=k_cache,
        block_tables=block_tables,
        cu_seqlens_q=cu_seqlens_q,
        context_lens=context_lens,
    )

    out = torch.empty_like(q)
    if num_tokens == 0 or batch == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    block_m = 64 if max_query_len > 32 else 16
    grid = (cdiv(max_query_len, block_m), batch, num_q_heads)
    paged_prefill_attention_kernel[grid](
        # pointers
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        out,
        # sizes
        scale * LOG2_E,
        num_q_heads // num_kv_heads,
        skip_fresh_from,
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
        out.stride(0),
        out.stride(1),
        # meta-parameters
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=64 if head_dim <= 128 else 32,
        DOT_PRECISION=dot_precision(q.dtype),
        FP16_DOTS=float16_dots(q.dtype, k_cache.dtype),
        num_warps=4,
        num_stages=2,
        **launch_options(q),
    )
    return out


# --------------------------------------------------------------------------- dispatch
def sdpa_min_prefill_len() -> int:
    """The shortest fresh chunk (nothing cached before it) that runs SDPA on CUDA when the varlen
    kernel does not: the measured constant, 1 when the environment forces SDPA, never when it
    forces Triton."""
    forced = forced_attention_backend(PREFILL_BACKEND_ENV_VAR, PREFILL_BACKENDS)
    if forced in (None, "flash"):
        return SDPA_MIN_PREFILL_LEN
    return 1 if forced == "sdpa" else NEVER


def whole_prompts_take_the_varlen_kernel(query_lens: list[int], kv_lens: list[int]) -> bool:
    """Whether a call's whole prompts (nothing cached before them) go through the varlen kernel:
    there are some, and none reaches `sdpa_min_prefill_len()` tokens, where per-prompt SDPA is
    faster than FlashAttention 2's varlen call (module doc), unless the environment forces the
    kernel or it is FlashAttention 3 (`flash_takes_long_sequences`)."""
    whole = [n for n, total in zip(query_lens, kv_lens) if n and n == total]
    if not whole:
        return False
    return forced_attention_backend(PREFILL_BACKEND_ENV_VAR, PREFILL_BACKENDS) == "flash" or (
        max(whole) < sdpa_min_prefill_len() or flash_takes_long_sequences()
    )


def fresh_prefill_through_flash() -> bool:
    """Whether the environment leaves fresh chunks to the varlen kernel (auto or flash)."""
    return forced_attention_backend(PREFILL_BACKEND_ENV_VAR, PREFILL_BACKENDS) in (None, "flash")


def paged_prefill_attention_per_sequence(
    q: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    query_lens: list[int],
    kv_lens: list[int],
    threshold: int | None = None,
    contexts: PackedContexts | None = None,
    flash: bool = True,
) -> torch.Tensor:
    """Fresh chunks through the causal varlen kernel when it can take them and none is long
    enough for SDPA (unless the environment forces the kernel), else those of at
    least `threshold` (default `sdpa_min_prefill_len()`) tokens through causal SDPA each, all on
    their own k/v (new_k/new_v [T, Hkv, D], rounded as the cache stores them); the rest in one
    Triton launch that skips them. `query_lens`/`kv_lens`: cu_seqlens_q's lengths and
    context_lens on the host. `flash=False` leaves the varlen kernel out (the per-chunk SDPA
    path alone, as `scripts/bench_kernels.py` times it). `contexts`: the step's
    `PackedContexts` for these sequences, shared across layers (else built here)."""
    starts = list(itertools.accumulate([0] + query_lens[:-1]))
    if flash and fresh_prefill_through_flash() and flash_varlen_usable(q, "causal"):
        # (start, length) of the chunks after a cached context; the others are whole prompts
        extended = [(start, n) for start, n, total in zip(starts, query_lens, kv_lens) if n and n != total]
        out = None
        if extended and sum(kv_lens) <= GATHER_MAX_KEYS and causal_with_context_supported(q):
            contexts = contexts or PackedContexts(block_tables, context_lens, kv_lens)
            out = _chunks_over_packed_contexts(q, k_cache, v_cache, cu_seqlens_q, scale, max(query_lens), contexts)
        elif whole_prompts_take_the_varlen_kernel(query_lens, kv_lens):
            out = _fresh_chunks_through_flash(q, new_k, new_v, k_cache, v_cache, block_tables, cu_seqlens_q,
                                              context_lens, scale, max(query_lens), extended)
        if out is not None:
            return out
    threshold = sdpa_min_prefill_len() if threshold is None else threshold
    by_sdpa = [n == total and n >= threshold for n, total in zip(query_lens, kv_lens)]  # the kernel's skip rule
    fresh = [(start, start + n) for start, n, sdpa in zip(starts, query_lens, by_sdpa) if sdpa]
    rest = [n for n, sdpa in zip(query_lens, by_sdpa) if n and not sdpa]
    if not fresh:
        return paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                                              max_query_len=max(rest, default=0))
    out = torch.empty_like(q)
    if rest:
        out = paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                                             max_query_len=max(rest), skip_fresh_from=threshold)
    for begin, end in fresh:
        keys, values = (_as_cached(x[begin:end], k_cache.dtype, q.dtype) for x in (new_k, new_v))  # [n, Hkv, D]
        context = F.scaled_dot_product_attention(
            q[begin:end].transpose(0, 1).unsqueeze(0),  # [1, Hq, n, D]
            keys.transpose(0, 1).unsqueeze(0),  # [1, Hkv, n, D]
            values.transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )  # [1, Hq, n, D]
        out[begin:end] = context[0].transpose(0, 1)  # [n, Hq, D]
    return out


def _chunks_over_packed_contexts(
    q, k_cache, v_cache, cu_seqlens_q, scale, max_query_len, contexts
) -> torch.Tensor | None:
    """One causal varlen launch, every chunk over its whole context gathered from the cache
    (bottom-right aligned); None if the kernel failed (the caller falls back)."""
    keys, values = (contexts.gather(cache, q.dtype) for cache in (k_cache, v_cache))  # [total, Hkv, D]
    _, cu_seqlens_k = contexts.layout(k_cache.shape[1])
    return try_flash_varlen_attention(CAUSAL_WITH_CONTEXT, q, keys, values, cu_seqlens_q, scale, max_query_len,
                                      causal=True, cu_seqlens_k=cu_seqlens_k, max_seqlen_k=contexts.max_len)


def _fresh_chunks_through_flash(
    q, new_k, new_v, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, max_query_len, extended
) -> torch.Tensor | None:
    """One causal varlen launch over every chunk's own k/v (right for the fresh chunks; the
    `extended` ones, (start, length) after a cached context, are then overwritten by one Triton
    launch that computes only them). None if the varlen kernel failed (the caller falls back)."""
    keys, values = (_as_cached(x, k_cache.dtype, q.dtype) for x in (new_k, new_v))  # [T, Hkv, D]
    out = try_flash_varlen_attention("causal", q, keys, values, cu_seqlens_q, scale, max_query_len, causal=True)
    if out is None or not extended:
        return out
    with_context = paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                                  scale, max_query_len=max(n for _, n in extended), skip_fresh_from=1)
    for begin, n in extended:
        out[begin:begin + n] = with_context[begin:begin + n]  # [n, Hq, D]
    return out


def _as_cached(values: torch.Tensor, cache_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """The chunk's own k or v as the cache holds them (an FP8 cache rounds), in the query's dtype."""
    return values if cache_dtype == dtype else to_cache_dtype(values, cache_dtype).to(dtype)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    host_lens: tuple[list[int], list[int]] | None = None,
    contexts: PackedContexts | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] (sequences packed by cu_seqlens_q [B+1]) -> [T, Hq, D]. With the chunks'
    own `new_kv` (k, v [T, Hkv, D], already written to the cache) and `host_lens` (the query
    lengths and context_lens on the host), CUDA calls choose a backend per sequence (module doc);
    `contexts`: a `PackedContexts` of these sequences that every layer of the step shares."""
    if not use_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, op="paged_prefill_attention"):
        return paged_prefill_attention_reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)
    if new_kv is None or host_lens is None or kernel_backend() == "triton":
        return paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                                              max_query_len=max_query_len)
    return paged_prefill_attention_per_sequence(q, *new_kv, k_cache, v_cache, block_tables, cu_seqlens_q,
                                                context_lens, scale, *host_lens, contexts=contexts)
