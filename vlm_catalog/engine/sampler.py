"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

All rows are processed together; only the random draws of seeded requests are
made per row. A sampled row is filtered (`filtered_distributions`) and then
drawn by inverting its cumulative distribution with one uniform number, which
draws from it exactly. Neither step sorts the vocabulary as a rule: top-k
takes the best tokens by `topk`, top-p first tries a window of the best
tokens, and rows with neither filter are drawn in token order.

A seeded request's uniform comes from a generator seeded by (seed, output
position), so its draws depend only on its seed and history: the same
whatever it is batched with, and the same whether jump-forward appended the
forced tokens or the model sampled them one by one. Its logits are the
model's, though, and those can differ in the last float bits with the batch
(matrix products are blocked by their row count, on CPU as on GPU: about
5e-6 in float32 on the tiny model), so a draw that lands within about 1e-4 of
a token boundary, or a greedy near-tie, can pick the neighbouring token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlm_catalog.device_upload import upload
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
    if num_rows != len(params) or num_rows != len(output_positions):  # a row for each request, in its order
        raise ValueError(f"{num_rows} logits rows for {len(params)} requests ({len(output_positions)} positions)")
    token_list = sample_tokens(logits, params, output_positions, generator).tolist()
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


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_positions: Sequence[int],
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """`sample`'s tokens [R] int64, left on the device: nothing here waits for it (top-p
    without top-k excepted, which checks its window's mass)."""
    num_rows = logits.shape[0]
    sampled_rows = [row for row, p in enumerate(params) if not p.greedy]
    if len(sampled_rows) == num_rows:  # nothing greedy: no argmax pass over the vocabulary
        return _sample_rows(logits, params, output_positions, generator)
    tokens = logits.argmax(dim=-1)
    if sampled_rows:
        index = upload(sampled_rows, logits.device, torch.int64)
        chosen = _sample_rows(
            logits.index_select(0, index),
            [params[row] for row in sampled_rows],
            [output_positions[row] for row in sampled_rows],
            generator,
        )
        tokens.index_copy_(0, index, chosen)
    return tokens


NUCLEUS_WINDOW = 1024  # best tokens tried first for top-p without top-k (a full sort if they hold too little mass)


@dataclass
class FilteredRows:
    """Some rows' filtered distributions: `probs` [r, W] over `ids` [r, W] (token ids;
    None: W is the vocabulary in token order), for the rows `rows` of the batch."""

    rows: list[int]
    probs: torch.Tensor
    ids: torch.Tensor | None


def filtered_distributions(logits: torch.Tensor, params: Sequence[SamplingParams]) -> list[FilteredRows]:
    """What `sample` draws from for each row of `logits` [R, V] (none greedy), in three groups.

    - top-k: the `max(top_k)` best tokens of each row, by `topk`;
    - top-p without top-k: the `NUCLEUS_WINDOW` best, with their probabilities
      under the whole vocabulary's softmax; when those hold no more than top-p of
      the mass (a flat distribution), the group falls back to a full sort;
    - neither (temperature and min-p only): the whole vocabulary, in token order.
    Top-p and min-p measure the probabilities left after top-k. A temperature
    keeps the order of a row, so ranked groups scale only the columns they keep.
    """
    device = logits.device
    num_rows, vocab = logits.shape
    groups: dict[str, list[int]] = {"top_k": [], "nucleus": [], "whole": []}
    for row, p in enumerate(params):
        groups["top_k" if p.top_k else "nucleus" if p.top_p < 1.0 else "whole"].append(row)
    filtered = []
    for kind, rows in groups.items():
        if not rows:
            continue
        part = logits if len(rows) == num_rows else logits.index_select(0, upload(rows, device, torch.int64))  # [r, V]
        part_params = [params[row] for row in rows]
        temperatures = upload([p.temperature for p in part_params], device, logits.dtype)[:, None]
        if kind == "top_k":
            values, ids = part.topk(min(vocab, max(p.top_k for p in part_params)), dim=-1)  # [r, k] best first
            filtered.append(FilteredRows(rows, _filter(values / temperatures, ids, part_params), ids))
        elif kind == "nucleus":
            filtered.append(_nucleus(rows, part / temperatures, part_params))
        else:
            filtered.append(FilteredRows(rows, _filter(part / temperatures, None, part_params), None))
    return filtered


def _nucleus(rows: list[int], scaled: torch.Tensor, params: Sequence[SamplingParams]) -> FilteredRows:
    """Top-p without top-k over tempered logits `scaled` [r, V]: the `NUCLEUS_WINDOW` best tokens
    when they hold more than top-p of every row's mass, else a full sort."""
    if NUCLEUS_WINDOW < scaled.shape[1]:
        log_normalizer = torch.logsumexp(scaled, dim=-1)  # [r]
        values, ids = scaled.topk(NUCLEUS_WINDOW, dim=-1)  # [r, window] best first, and their token ids
        top_p = upload([p.top_p for p in params], scaled.device, values.dtype)
        window_mass = torch.exp(torch.logsumexp(values, dim=-1) - log_normalizer)  # [r]
        if bool((window_mass > top_p).all()):  # else the nucleus may reach past the window
            return FilteredRows(rows, _filter(values, ids, params, log_normalizer), ids)
    values, ids = scaled.sort(dim=-1, descending=True)  # [r, V]
    return FilteredRows(rows, _filter(values, ids, params), ids)


def _filter(
    values: torch.Tensor,
    ids: torch.Tensor | None,
    params: Sequence[SamplingParams],
    log_normalizer: torch.Tensor | None = None,
) -> torch.Tensor:
    """Probabilities [R, W] of the columns of `values` [R, W] (tempered logits) after the filters.

    With `ids`, the columns are each row's best tokens, best first, and top-k and
    top-p apply; without, they are the whole vocabulary in token order (top-k and
    top-p off). min-p applies to both. `log_normalizer` [R] (top-k off, the
    columns a window of the vocabulary) is the whole row's log-sum-exp, to
    measure top-p and min-p with.
    """
    device = values.device
    width = values.shape[1]
    remove = None
    kept = values
    if ids is not None:
        top_k = upload([p.top_k or width for p in params], device, torch.int64)
        remove = torch.arange(width, device=device)[None, :] >= top_k[:, None]  # [R, W]
        kept = values.masked_fill(remove, float("-inf"))
    if log_normalizer is None:
        probs = torch.softmax(kept, dim=-1)  # [R, W]
    else:
        probs = torch.exp(kept - log_normalizer[:, None])  # [R, W], of the whole vocabulary's mass
    if ids is not None and any(p.top_p < 1.0 for p in params):
        top_p = upload([p.top_p for p in params], device, probs.dtype)
        before = probs.cumsum(dim=-1) - probs  # mass of the better tokens
        remove |= before > top_p[:, None]
    if any(p.min_p > 0.0 for p in params):
        min_p = upload([p.min_p for p in params], device, probs.dtype)
        too_unlikely = probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # the best token always stays
        remove = too_unlikely if remove is None else remove | too_unlikely
    if remove is None:
        return probs
    if ids is not None:
        remove[:, 0] = False  # the best token always stays
    return torch.softmax(values.masked_fill(remove, float("-inf")), dim=-1)


def _sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_positions: Sequence[int],
    generator: torch.Generator | None,
) -> torch.Tensor:
    """A token id per row of `logits` [R, V], drawn from its filtered, tempered distribution."""
    num_rows = logits.shape[0]
    chosen = None
    for group in filtered_distributions(logits, params):
        picked = _draw(group, [params[row] for row in group.rows], [output_positions[row] for row in group.rows], generator)
        if len(group.rows) == num_rows:
            return picked
        if chosen is None:
            chosen = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
        chosen.index_copy_(0, upload(group.rows, logits.device, torch.int64), picked)
    return chosen


def _draw(
    group: FilteredRows,
    params: Sequence[SamplingParams],
    output_positions: Sequence[int],
    generator: torch.Generator | None,
) -> torch.Tensor:
    """A token id per row of the group [r]: its cumulative distribution inverted at one uniform number."""
    uniforms = _uniforms(params, output_positions, generator, group.probs.device)
    cumulative = group.probs.cumsum(dim=-1)  # [r, W]
    total = cumulative[:, -1:]  # [r, 1]
    # u * total, kept below the total when rounding would reach it (columns past the last
    # kept token have the total too, and must not be found)
    target = torch.minimum((uniforms[:, None] * total).to(total.dtype), torch.nextafter(total, torch.zeros_like(total)))
    # the first column whose cumulative mass passes the target: column c with probability probs[c]
    column = torch.searchsorted(cumulative, target, right=True)  # [r, 1]
    # NaN probabilities (logits of inf or NaN) find no column: W, one past the end. Kept inside the row,
    # so a broken row gives a wrong token of the vocabulary, never an index that fails the next step
    column = column.clamp_(max=cumulative.shape[1] - 1)
    return column.squeeze(1) if group.ids is None else group.ids.gather(1, column).squeeze(1)


def sample_most_memory(logits: torch.Tensor) -> torch.Tensor:
    """Draw a token per row of `logits` [R, V] through the sampler's most memory-hungry path
    (top-p over a full sort of the vocabulary), for the memory profile of a worst-case step."""
    params = [SamplingParams(temperature=1.0, top_p=0.99)] * logits.shape[0]
    values, ids = logits.sort(dim=-1, descending=True)  # [R, V]
    rows = list(range(logits.shape[0]))
    return _draw(FilteredRows(rows, _filter(values, ids, params), ids), params, [0] * len(rows), None)


def _uniforms(
    params: Sequence[SamplingParams],
    output_positions: Sequence[int],
    generator: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """U[0, 1) [R] in float64: one draw for the unseeded rows, and for a seeded row one from
    (seed, position), so its token depends on nothing else in the batch."""
    uniforms = torch.rand(len(params), device=device, dtype=torch.float64, generator=generator)
    for row, (p, position) in enumerate(zip(params, output_positions)):
        if p.seed is not None:
            row_generator = torch.Generator(device=device).manual_seed(_position_seed(p.seed, position))
            uniforms[row] = torch.rand((), device=device, dtype=torch.float64, generator=row_generator)
    return uniforms


def _position_seed(seed: int, position: int) -> int:
    return (seed * 1_000_003 + position * 7_919 + 0x9E3779B9) % (2**63 - 1)
