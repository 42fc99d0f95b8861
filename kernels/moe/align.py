"""Group the (token, k) pairs of a routing decision by expert, in blocks.

The grouped GEMMs of `fused_moe` process BLOCK_SIZE_M rows of one expert per
program, so each expert's pairs are laid out contiguously and padded up to a
multiple of `block_size`:

* ``sorted_token_ids`` [max_padded] int32: flat pair indices ``t * K + k``,
  expert by expert (ascending), in pair order within an expert; padding entries
  hold ``T * K`` (one past the last pair), which the GEMMs mask out. Its length
  ``max_padded`` is a bound known without looking at the ids:
  ``T*K + min(E, T*K) * (block_size - 1)``, rounded up to a multiple of block_size.
* ``expert_ids`` [max_padded // block_size] int32: the expert of each block.
* ``num_tokens_post_padded`` [1] int32: how many entries of sorted_token_ids are
  used (a device tensor, so the GEMM launch needs no host sync).

Entries past the used ones (``sorted_token_ids[num_tokens_post_padded:]`` and the
matching ``expert_ids``) are unspecified: the GEMMs never read them. The
reference fills them (T*K and -1); the Triton path leaves them unwritten, which
saves three fill launches per MoE layer.

Expert ids must lie in [0, num_experts).

The Triton path takes three launches over chunks of pairs (a count per chunk, the offsets
in one program, a scatter per expert and chunk: kernels/jit/moe_align.py); up to
`SINGLE_LAUNCH_MAX_PAIRS` pairs (decode batches) it takes one, whose programs each count all
experts' pairs themselves (E x T*K compares per program: cheap for a few pairs, not for a
prefill's). The threshold comes from the H100 crossover (`scripts/bench_kernels.py`, rows
`moe_align_block_size[one launch]`; docs/benchmarks.md), measured against the two launches
of before 2026-11-28. On the Triton path, decode batches of up to
`ROUTE_ALIGN_MAX_TOKENS` tokens (`kernels.moe.routing`) do not come here:
`route_topk_and_align` routes and aligns them in one launch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.checks import INDEX_DTYPES, check_dtype
from kernels.dispatch import use_triton
from kernels.launch_math import cdiv, next_power_of_2
from kernels.pdl import launch_options

# Measured on an H100 (2026-11-25, docs/results/gpu/bench_gpu_2026-11-25.json): one launch is 1.30x and 1.03x
# two at 8 and 128 pairs (1 and 16 tokens at K=8) and 0.35x at 2048, so the crossover is near 128.
SINGLE_LAUNCH_MAX_PAIRS = 128
COUNT_TILE = 8192  # compares per step of the in-program count: [BLOCK_EXPERTS, COUNT_TILE // BLOCK_EXPERTS]
# the three-launch path's chunks: a power of two of pairs, at least ALIGN_CHUNK_PAIRS, and at most
# MAX_ALIGN_CHUNKS of them (the offsets program holds a [chunks, experts] table): 64 chunks of 2048
# pairs at 16k tokens, so 64 x E scatter programs each scan 2048 ids where E programs scanned 131k;
# 8 chunks of 256 at a decode batch of 256, so that 8 programs share the count
ALIGN_CHUNK_PAIRS = 256
MAX_ALIGN_CHUNKS = 64


class MoeAlignment(NamedTuple):
    """The layout above, made for GEMM blocks of `block_size` rows (`fused_moe` checks that its
    config's block_size_m is the same before it uses one made ahead, as
    `kernels.moe.routing.route_topk_and_align` does for decode batches)."""

    sorted_token_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor
    block_size: int


def max_padded_pairs(num_pairs: int, num_experts: int, block_size: int) -> int:
    """Upper bound of the padded length: each expert that is hit adds < block_size padding."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_size - 1)
    return -(-bound // block_size) * block_size


def empty_alignment(
    num_pairs: int, num_experts: int, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised (sorted_token_ids, expert_ids, num_tokens_post_padded) for the Triton paths,
    which write them whole up to num_tokens_post_padded (the rest stays unspecified)."""
    max_padded = max_padded_pairs(num_pairs, num_experts, block_size)
    return (
        torch.empty((max_padded,), dtype=torch.int32, device=device),
        torch.empty((max_padded // block_size,), dtype=torch.int32, device=device),
        torch.empty((1,), dtype=torch.int32, device=device),
    )


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pairs per expert [E] int64 for expert ids of any shape, on their device, by a scatter
    into E counters: no host sync (`torch.bincount` reads the ids' maximum back to size its
    output, which also keeps it out of CUDA graphs)."""
    flat = expert_ids.reshape(-1).long()
    return flat.new_zeros(num_experts).scatter_add_(0, flat, torch.ones_like(flat))


def moe_align_block_size_reference(
    topk_ids: torch.Tensor, num_experts: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    device = topk_ids.device
    flat_ids = topk_ids.reshape(-1).long()  # [T*K]
    num_pairs = flat_ids.numel()
    max_padded = max_padded_pairs(num_pairs, num_experts, block_size)

    counts = expert_counts(flat_ids, num_experts)  # [E]
    padded_counts = (counts + block_size - 1) // block_size * block_size  # [E]
    padded_starts = torch.cumsum(padded_counts, 0) - padded_counts  # [E]
    count_starts = torch.cumsum(counts, 0) - counts  # [E]

    order = torch.argsort(flat_ids, stable=True)  # pair indices, expert by expert
    sorted_experts = flat_ids[order]
    rank_in_expert = torch.arange(num_pairs, device=device) - count_starts[sorted_experts]
    destination = padded_starts[sorted_experts] + rank_in_expert

    sorted_token_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_token_ids[destination] = order.to(torch.int32)
    expert_ids = torch.full((max_padded // block_size,), -1, dtype=torch.int32, device=device)
    blocks_per_expert = padded_counts // block_size  # [E]
    used_blocks = torch.repeat_interleave(
        torch.arange(num_experts, device=device), blocks_per_expert
    )
    expert_ids[: used_blocks.numel()] = used_blocks.to(torch.int32)
    num_tokens_post_padded = padded_counts.sum().reshape(1).to(torch.int32)
    return sorted_token_ids, expert_ids, num_tokens_post_padded


def moe_align_block_size_triton(
    topk_ids: torch.Tensor, num_experts: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three launches over chunks of pairs: count each expert's pairs per chunk, turn the counts
    into each (chunk, expert)'s first entry, scatter each chunk's pairs of each expert in order.
    Up to SINGLE_LAUNCH_MAX_PAIRS pairs, one: the scatter programs count for themselves."""
    from kernels.jit.moe_align import moe_count_kernel, moe_offsets_kernel, moe_scatter_kernel

    check_dtype("topk_ids", topk_ids, INDEX_DTYPES)
    if block_size < 1 or num_experts < 1:
        raise ValueError(f"block_size ({block_size}) and num_experts ({num_experts}) must be >= 1")
    device = topk_ids.device
    flat_ids = topk_ids.reshape(-1)  # [T*K]
    num_pairs = flat_ids.numel()
    sorted_token_ids, expert_ids, num_tokens_post_padded = empty_alignment(num_pairs, num_experts, block_size, device)
    if num_pairs == 0:
        return sorted_token_ids, expert_ids, num_tokens_post_padded.zero_()
    block_experts = next_power_of_2(num_experts)
    count_here = num_pairs <= SINGLE_LAUNCH_MAX_PAIRS
    chunk_size = num_pairs if count_here else align_chunk_size(num_pairs)
    num_chunks = cdiv(num_pairs, chunk_size)
    count_block = max(1, min(COUNT_TILE // block_experts, next_power_of_2(chunk_size)))
    offsets = expert_totals = flat_ids  # placeholders, never read when the scatter counts itself
    if not count_here:
        chunk_counts = torch.empty((num_chunks, num_experts), dtype=torch.int32, device=device)
        offsets = torch.empty_like(chunk_counts)  # [chunks, E]
        expert_totals = torch.empty((num_experts,), dtype=torch.int32, device=device)
        moe_count_kernel[(num_chunks,)](
            flat_ids, chunk_counts, num_pairs, num_experts, chunk_size,
            BLOCK_EXPERTS=block_experts, COUNT_BLOCK=count_block, num_warps=4, **launch_options(flat_ids),
        )
        moe_offsets_kernel[(1,)](
            chunk_counts, offsets, expert_totals, num_tokens_post_padded, num_chunks, num_experts, block_size,
            BLOCK_CHUNKS=next_power_of_2(num_chunks), BLOCK_EXPERTS=block_experts, num_warps=4,
            **launch_options(flat_ids),
        )
    moe_scatter_kernel[(num_experts, num_chunks)](
        # pointers
        flat_ids,
        offsets,
        expert_totals,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        # sizes
        num_pairs,
        num_experts,
        block_size,
        chunk_size,
        # meta-parameters
        BLOCK=min(next_power_of_2(chunk_size), 1024),
        BLOCK_EXPERTS=block_experts,
        COUNT_HERE=count_here,
        COUNT_BLOCK=count_block,
        num_warps=4,
        **launch_options(flat_ids),
    )
    return sorted_token_ids, expert_ids, num_tokens_post_padded


def align_chunk_size(num_pairs: int) -> int:
    """Pairs per chunk of the three-launch path: a power of two (one Triton variant), at least
    ALIGN_CHUNK_PAIRS, and large enough for at most MAX_ALIGN_CHUNKS chunks."""
    return max(ALIGN_CHUNK_PAIRS, next_power_of_2(cdiv(num_pairs, MAX_ALIGN_CHUNKS)))


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] -> (sorted_token_ids, expert_ids, num_tokens_post_padded)."""
    if use_triton(topk_ids, op="moe_align_block_size"):
        return moe_align_block_size_triton(topk_ids, num_experts, block_size)
    return moe_align_block_size_reference(topk_ids, num_experts, block_size)
