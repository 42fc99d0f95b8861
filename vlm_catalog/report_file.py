"""A `--json REPORT` argument: checked before the work, written after it, errors in one line.

A report is written at the end of a run that may have scored millions of
records, so its path is checked first (not a folder; its folder created) and
a failure to write it (a full disk) is a `ReportFileError` naming the file,
not a traceback that hides the numbers already printed.
"""

from __future__ import annotations

import sys
from pathlib import Path


class ReportFileError(ValueError):
    """The report file cannot be written; the message names it and says why."""


def check_report_path(path: Path, option: str = "--json") -> None:
    """Refuse a folder; create the report's folder if it is missing (`option`: the argument named)."""
    if path.is_dir():
        raise ReportFileError(f"{option} {path} is a folder; give a file name such as {path / 'report.json'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReportFileError(f"{option} {path}: cannot create its folder {path.parent} ({exc.strerror})") from None


def write_report(path: Path, text: str, option: str = "--json") -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ReportFileError(f"{option} {path}: cannot write it ({exc.strerror or exc})") from None


def refuse_report_path(path: Path | None, option: str = "--json") -> bool:
    """`check_report_path` for a command's `main`: True (the error printed in one line) when the
    report could not be written; False when it can, or when no report was asked for (`path` None)."""
    if path is None:
        return False
    try:
        check_report_path(path, option)
    except ReportFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return True
    return False


def report_written(path: Path, text: str, option: str = "--json") -> bool:
    """`write_report` for a command's `main`: False (the error printed in one line) when it failed."""
    try:
        write_report(path, text, option)
    except ReportFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return False
    return True
