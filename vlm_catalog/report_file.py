"""A `--json REPORT` argument: checked before the work, written after it, errors in one line.

A report is written at the end of a run that may have scored millions of
records, so its path is checked first (not a folder; its folder created) and
a failure to write it (a full disk) is a `ReportFileError` naming the file,
not a traceback that hides the numbers already printed.
"""

from __future__ import annotations

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
