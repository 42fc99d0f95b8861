"""An exception as one line of text, for errors that must fit one line (a record's `error`,
a CLI's `error:` line), whatever newlines a library put in its message."""

from __future__ import annotations


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def validation_problems(exc, whole: str = "") -> str:
    """A pydantic `ValidationError` as one line: each field and its message, without pydantic's
    docs URL; `whole` names a problem of the whole value (an empty location)."""
    return "; ".join(f"{'.'.join(map(str, item['loc'])) or whole}: {item['msg']}" for item in exc.errors())
