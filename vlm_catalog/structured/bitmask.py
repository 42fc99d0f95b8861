"""Token bitmasks: one int32 word per 32 vocabulary ids, bit set = token allowed.

The engine allocates one `[max_batch, ceil(mask_size/32)]` bitmask on the CPU once
in `BitmaskBuffer` (pinned, with a device copy, on CUDA; `mask_size`: the tokenizer's
ids, `GrammarVocabulary.mask_size`, the logits' padding past them never allowed), each grammar request
fills its row (`GrammarState.fill_bitmask`) while the device runs the forward
pass, and `apply_bitmask` sets the disallowed logits of those rows to -inf in one
batched call, on the logits' device (xgrammar's CPU kernel or, on CUDA, its
Triton kernel).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import xgrammar as xgr

from vlm_catalog.device_upload import upload

BITS_PER_WORD = 32


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """An int32 CPU tensor `[batch_size, ceil(vocab_size / 32)]`, every token allowed."""
    if batch_size < 1 or vocab_size < 1:
        raise ValueError(
            f"bitmask needs batch_size >= 1 and vocab_size >= 1, got {batch_size} and {vocab_size}"
        )
    return xgr.allocate_token_bitmask(batch_size, vocab_size)


class BitmaskBuffer:
    """A bitmask allocated once and reused every step, with a device copy.

    `host(n)` gives the first n rows, reset to "every token allowed", for the
    grammar requests to fill on the CPU (while the device runs the forward pass);
    `device(n)` copies them to the device in one transfer, from pinned memory
    and without blocking the host when the device is CUDA. Reusing the pinned
    rows is safe because every engine step waits for its sampled tokens (after
    the copy) before the next step fills them again.
    """

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device | str = "cpu") -> None:
        device = torch.device(device)
        host = allocate_bitmask(max_rows, vocab_size)  # [max_rows, W] int32, all allowed
        self._host = host.pin_memory() if device.type == "cuda" else host
        self._device = self._host if device.type == "cpu" else torch.empty_like(self._host, device=device)
        self.max_rows = max_rows

    def host(self, num_rows: int) -> torch.Tensor:
        """Rows [num_rows, W] on the CPU, every token allowed, to fill."""
        if not 1 <= num_rows <= self.max_rows:
            raise ValueError(f"num_rows must be in 1..{self.max_rows}, got {num_rows}")
        rows = self._host[:num_rows]
        rows.fill_(-1)  # all 32 bits set: every token allowed
        return rows

    def device(self, num_rows: int) -> torch.Tensor:
        """The first num_rows filled rows on the device (one non-blocking copy)."""
        if self._device is self._host:
            return self._host[:num_rows]
        return self._device[:num_rows].copy_(self._host[:num_rows], non_blocking=True)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set `logits[r, t] = -inf` for every token `t` not allowed by `bitmask[r]`, for `r` in `rows`.

    In place. `logits` is `[B, V]` (any float dtype, CPU or CUDA); `bitmask` is
    `[B, W]` and covers the first `32 W` columns: the listed rows' columns past those
    are never allowed (the vocabulary's padding past the tokenizer: grammar rows
    cover the tokenizer's ids only, `GrammarVocabulary.mask_size`). Rows not listed
    (requests without a grammar) are left untouched. The bitmask is copied to the
    logits' device if needed.
    """
    rows = [int(r) for r in rows]
    if not rows:
        return
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(
            "expected logits [B, V] and bitmask [B, W], "
            f"got {tuple(logits.shape)} and {tuple(bitmask.shape)}"
        )
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    covered = min(logits.shape[1], bitmask.shape[1] * BITS_PER_WORD)
    if len(set(rows)) != len(rows):
        raise ValueError(f"rows must be unique, got {rows}")
    batch_limit = min(logits.shape[0], bitmask.shape[0])
    bad_rows = [r for r in rows if not 0 <= r < batch_limit]
    if bad_rows:
        raise ValueError(f"rows {bad_rows} are outside the batch of {batch_limit}")
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=covered, indices=rows)
    if covered < logits.shape[1]:
        # the engine's logits come from an inference-mode forward: written in place only in that mode
        with torch.inference_mode(logits.is_inference()):
            past = logits[:, covered:]  # [B, V - covered] view: the columns no row covers
            if rows == list(range(logits.shape[0])):
                past.fill_(float("-inf"))
            else:
                past.index_fill_(0, upload(rows, logits.device, torch.int64), float("-inf"))


def allow_only_token(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Make `bitmask[row]` allow exactly one token."""
    word, bit = divmod(token_id, BITS_PER_WORD)
    bitmask[row].zero_()
    bitmask[row, word] = _word_with_bit(bit)


def allow_only_tokens(bitmask: torch.Tensor, rows: Sequence[int], token_ids: Sequence[int]) -> None:
    """Make each `bitmask[rows[i]]` allow exactly `token_ids[i]`: `allow_only_token` for many rows in
    two tensor operations, not two per row (a step's forced rows; `rows` must be unique)."""
    if len(rows) != len(token_ids):
        raise ValueError(f"{len(rows)} rows for {len(token_ids)} tokens")
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.int64)
    words = torch.tensor([token_id // BITS_PER_WORD for token_id in token_ids], dtype=torch.int64)
    values = torch.tensor([_word_with_bit(token_id % BITS_PER_WORD) for token_id in token_ids], dtype=torch.int32)
    bitmask.index_fill_(0, index, 0)
    bitmask.index_put_((index, words), values)


def row_token_ids(bitmask_row: torch.Tensor, limit: int) -> list[int]:
    """The token ids below `limit` whose bit is set in one bitmask row."""
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32)
    bits = (bitmask_row.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # [W, 32]
    return [t for t in bits.flatten().nonzero().flatten().tolist() if t < limit]


def row_allows_only(bitmask_row: torch.Tensor, token_ids: Iterable[int]) -> bool:
    """True if no token outside `token_ids` is allowed by the row."""
    remaining = bitmask_row.clone()
    for token_id in token_ids:
        word, bit = divmod(token_id, BITS_PER_WORD)
        remaining[word] &= ~_word_with_bit(bit)
    return not bool(remaining.any())


def _word_with_bit(bit: int) -> int:
    """The int32 value with only `bit` set (bit 31 is the sign bit)."""
    value = 1 << bit
    return value - (1 << BITS_PER_WORD) if bit == BITS_PER_WORD - 1 else value
