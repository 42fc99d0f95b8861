"""An exception as one line of text, for errors that must fit one line (a record's `error`,
a CLI's `error:` line), whatever newlines a library put in its message."""

from __future__ import annotations


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
