"""argparse `type=` checks of numeric options, shared by the `python -m` tools and the scripts.

A value out of range is argparse's own error, naming the option (exit 2), before any work: not
a traceback after a model has loaded (`--count 0` failed inside the benchmark; `--records 0`
once the probes' images had been through the tower).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(least: int) -> Callable[[str], int]:
    """`type=` of an integer option whose value must be `least` or more."""

    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    return integer


positive_int = at_least(1)  # a count of records, repeats, tokens
