"""A/B runs in interleaved rounds (A, B, A, B, ...), so a drift in the machine's speed hits both settings alike."""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Sequence
from typing import Any


def interleaved_rounds(
    settings: Sequence[Hashable],
    rounds: int,
    run: Callable[[Hashable], tuple[dict[str, Any], Any]],
    warm_up: Callable[[Hashable], object] | None = None,
) -> tuple[list[dict[str, Any]], dict[Hashable, Any]]:
    """`run(setting)` -> (report row, answers) for each setting, `rounds` times in turn.

    `warm_up(setting)` runs once per setting first, untimed (thread pools, the
    allocator, first-call costs). Prints each row as a JSON line when it is
    measured. Returns every row, and the last answers of each setting (to check
    that the settings agree).
    """
    for setting in settings if warm_up is not None else ():
        warm_up(setting)
    rows: list[dict[str, Any]] = []
    answers: dict[Hashable, Any] = {}
    for _ in range(rounds):
        for setting in settings:
            row, answers[setting] = run(setting)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows, answers
