"""A `--json REPORT` argument: checked before the work, written after it, errors in one line.

A report is written at the end of a run that may have scored millions of
records, so its path is checked first (not a folder; its folder writable, or one that can be made) and
a failure to write it (a full disk) is a `ReportFileError` naming the file,
not a traceback that hides the numbers already printed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

from vlm_catalog.folders import check_folder_can_be_made


class ReportFileError(ValueError):
    """The report file cannot be written; the message names it and says why."""


def check_report_path(path: Path, option: str = "--json", inputs: Iterable[Path | None] = ()) -> None:
    """Refuse a folder, a file whose folder could not be made or written, and a path where the
    report would replace one of the run's `inputs` (one of those files, or a file inside one of
    those folders: before, `eval --json` given its own predictions file replaced them). `option`:
    the argument named. Nothing is created: `write_report` makes the folder."""
    if path.is_dir():
        raise ReportFileError(f"{option} {path} is a folder; give a file name such as {path / 'report.json'}")
    replaced = replaced_input(path, inputs)
    if replaced is not None:
        raise ReportFileError(f"{option} {path} would replace {replaced}, an input of this run; choose another path")
    try:
        check_folder_can_be_made(path.parent, f".{path.name}.write-check")
    except OSError as exc:
        raise ReportFileError(f"{option} {path}: cannot write into its folder {path.parent} ({exc.strerror})") from None


def replaced_input(path: Path, inputs: Iterable[Path | None]) -> Path | None:
    """The input (a file, or an existing file inside an input folder) that writing `path` would
    replace, or None; links resolved."""
    target = Path(path).resolve()
    for source in inputs:
        if source is None:
            continue
        resolved = Path(source).resolve()
        if target == resolved or (resolved.is_dir() and target.is_relative_to(resolved) and target.exists()):
            return Path(source) if target == resolved else target
    return None


def write_report(path: Path, text: str, option: str = "--json") -> None:
    try:
        if not path.parent.exists():  # a file in its place: the write below says "Not a directory"
            path.parent.mkdir(parents=True)
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
