"""Multimodal RoPE positions (temporal, height, width) for a prompt with images.

Text tokens advance one position on all three axes. The tokens of an image of
merged grid (t, h, w) take positions `start + (t_index, row, col)`, and the text
after it resumes at `start + max(h, w)`; this is transformers' `get_rope_index`
for Qwen3-VL. Decoding continues from there: the token at sequence index n >= L
sits at position `n + delta` on every axis, with `delta = max(position) + 1 - L`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def mrope_positions(
    num_tokens: int,
    image_spans: Sequence[tuple[int, int]],
    image_grids: Sequence[tuple[int, int, int]],
    merge_size: int,
) -> tuple[torch.Tensor, int]:
    """Positions [3, num_tokens] (int64) and the decode delta for one prompt.

    `image_spans[i] = (start, length)` locates image i's placeholder tokens;
    `image_grids[i] = (t, h, w)` is its patch grid before merging.
    """
    if len(image_spans) != len(image_grids):
        raise ValueError(f"{len(image_spans)} image spans for {len(image_grids)} image grids")
    pieces: list[torch.Tensor] = []
    cursor = 0  # next token index
    position = 0  # next text position
    for (start, length), (t, h, w) in sorted(zip(image_spans, image_grids)):
        merged_h, merged_w = h // merge_size, w // merge_size
        if length != t * merged_h * merged_w:
            raise ValueError(f"image span of {length} tokens does not fit grid {(t, h, w)}")
        if start < cursor:
            raise ValueError("image spans overlap")
        pieces.append(_text_positions(start - cursor, position))
        position += start - cursor
        grid_t, grid_h, grid_w = torch.meshgrid(
            torch.arange(t), torch.arange(merged_h), torch.arange(merged_w), indexing="ij"
        )
        pieces.append(torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + position)  # [3, length]
        position += max(merged_h, merged_w)
        cursor = start + length
    if cursor > num_tokens:
        raise ValueError("an image span runs past the end of the prompt")
    pieces.append(_text_positions(num_tokens - cursor, position))
    positions = torch.cat(pieces, dim=1)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta


def mrope_delta(
    num_tokens: int,
    image_spans: Sequence[tuple[int, int]],
    image_grids: Sequence[tuple[int, int, int]],
    merge_size: int,
) -> int:
    """The decode delta of `mrope_positions` without building the positions."""
    if num_tokens == 0:
        return 0
    cursor = position = 0
    for (start, length), (t, h, w) in sorted(zip(image_spans, image_grids)):
        position += start - cursor
        last_image_position = position + max(t, h // merge_size, w // merge_size) - 1
        position += max(h // merge_size, w // merge_size)
        cursor = start + length
    end_position = position + (num_tokens - cursor) - 1 if num_tokens > cursor else position - 1
    highest = max(end_position, last_image_position) if image_spans else num_tokens - 1
    return highest + 1 - num_tokens


def decode_positions(sequence_indices: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """Positions [3, n] of generated tokens at `sequence_indices` [n] with per-token `deltas` [n]."""
    return (sequence_indices + deltas).unsqueeze(0).expand(3, -1)


def _text_positions(count: int, start: int) -> torch.Tensor:
    return (torch.arange(count) + start).unsqueeze(0).expand(3, -1)  # [3, count]
