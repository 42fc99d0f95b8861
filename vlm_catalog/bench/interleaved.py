"""A/B runs in interleaved rounds (A, B, A, B, ...), so a drift in the machine's speed hits both settings alike."""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Sequence
from typing import Any


def interleaved_rounds(
    settings: Sequence[Hashable], rounds: int, run: Callable[[Hashable], tuple[dict[str, Any], Any]]
) -> tuple[list[dict[str, Any]], dict[Hashable, Any]]:
    """`run(setting)` -> (report row, answers) for each setting, `rounds` times in turn.

    Prints each row as a JSON line when it is measured. Returns every row, and
    the last answers of each setting (to check that the settings agree).
    """
    rows: list[dict[str, Any]] = []
    answers: dict[Hashable, Any] = {}
    for _ in range(rounds):
        for setting in settings:
            row, answers[setting] = run(setting)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows, answers
