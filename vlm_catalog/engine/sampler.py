"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

All rows are processed together; only the random draws of seeded requests are
made per row. Sampling uses the exponential race (argmax of p / E with
E ~ Exp(1)), which draws from p exactly and lets each row use its own
generator. A seeded request's noise is drawn from a generator seeded by
(seed, output position), so its tokens depend only on its seed and history:
the same whatever it is batched with, and the same whether jump-forward
appended the forced tokens or the model sampled them one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlm_catalog.engine.sampling_params import SamplingParams


@dataclass
class SamplingResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_positions: Sequence[int],
    generator: torch.Generator | None = None,
) -> SamplingResult:
    """Pick one token per row of `logits` [R, V] (float32; grammar masks already applied)."""
    num_rows, vocab = logits.shape
    tokens = logits.argmax(dim=-1)
    sampled_rows = [row for row, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        index = torch.tensor(sampled_rows, device=logits.device)
        chosen = _sample_rows(
            logits.index_select(0, index),
            [params[row] for row in sampled_rows],
            [output_positions[row] for row in sampled_rows],
            generator,
        )
        tokens.index_copy_(0, index, chosen)
    token_list = tokens.tolist()
    logprobs: list[dict[int, float] | None] = [None] * num_rows
    wanted = [row for row, p in enumerate(params) if p.logprobs is not None]
    if wanted:
        log_probs = torch.log_softmax(logits[wanted].float(), dim=-1)
        for position, row in enumerate(wanted):
            top = params[row].logprobs
            entry = {token_list[row]: float(log_probs[position, token_list[row]])}
            if top:
                values, ids = log_probs[position].topk(min(top, vocab))
                entry.update(zip(ids.tolist(), values.tolist()))
            logprobs[row] = entry
    return SamplingResult(token_list, logprobs)


def _sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_positions: Sequence[int],
    generator: torch.Generator | None,
) -> torch.Tensor:
    device = logits.device
    temperatures = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    scaled = logits / temperatures[:, None]  # [R, V]
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)  # [R, V]
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=device)[None, :]
    top_k = torch.tensor([p.top_k or vocab for p in params], device=device)
    remove = rank >= top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=probs.dtype)
    before = probs.cumsum(dim=-1) - probs  # mass of the better tokens
    remove |= before > top_p[:, None]
    min_p = torch.tensor([p.min_p for p in params], device=device, dtype=probs.dtype)
    remove |= probs < min_p[:, None] * probs[:, :1]
    remove[:, 0] = False  # the best token always stays
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    noise = torch.empty_like(probs)
    for row, (p, position) in enumerate(zip(params, output_positions)):
        row_generator = generator
        if p.seed is not None:
            row_generator = torch.Generator(device=device).manual_seed(_position_seed(p.seed, position))
        noise[row].exponential_(generator=row_generator)
    choice = (probs / noise).argmax(dim=-1)  # [R], index into the sorted order
    return sorted_ids.gather(1, choice[:, None]).squeeze(1)


def _position_seed(seed: int, position: int) -> int:
    return (seed * 1_000_003 + position * 7_919 + 0x9E3779B9) % (2**63 - 1)
