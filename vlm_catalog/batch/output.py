"""The results file: one JSON line per record, written once, kept across crashes.

Contract:
- `ResultsFile.claim(path, job)` takes an exclusive lock (`fcntl.flock` on
  `<path>.lock`, released by the kernel when the process dies, however it
  dies), so a second process on the same file is refused, not interleaved.
  The path is resolved first: a symbolic link and its target are one file, one
  lock, and the file written is the target (the link stays).
- Every rewrite goes through a hidden temporary file next to the file
  (`.<name>.XXXXXXXX.tmp`/`.retry`/`.clean`), renamed over it when complete.
  A process killed mid-rewrite (kill -9, power loss) leaves its temporary
  file behind; the next `open`, holding the lock, removes such leftovers
  (unlocked, on a file system without locks, it leaves them).
- Resuming, it reads the existing file: every complete line with an `id` is a
  finished record. A last line without its newline (a crash mid-write) is cut
  off (only those bytes; nothing complete is ever removed). Duplicate ids or
  damaged complete lines (which this writer never makes) are dropped by
  writing a cleaned copy next to the file and renaming it over the original.
- `<path>.job.json` records what the file holds (dataset, split, shard, model,
  schema, prompt, budget); resuming with different settings is refused, so
  one file never mixes answers of two jobs.
- `claim` changes nothing in the file but a repair; `start`, called once the
  run can go on (its model loaded), empties it (`overwrite`, or a new file)
  and writes the job file. A start refused in between (a model that does not
  load, a device that is not there, a signal) leaves the file and its job as
  they were: before, `--overwrite` had emptied it, and a new file was left
  with the refused settings' job, which the corrected command then refused.
  `open` is `claim` then `start`.
- `write(line)` appends one line and flushes it to the kernel at once (a killed
  process loses nothing written); `close()` fsyncs. The file is never opened
  for truncation: `overwrite` renames an empty file over it.
- At every fsync and at `close()`, the path must still name the file being
  written; if it was deleted, moved or replaced, `OutputError` says how many
  lines this run wrote, instead of the run reporting lines that are not there.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any, BinaryIO

from vlm_catalog.atomic_files import replace_atomically, write_atomically

LOCK_SUFFIX = ".lock"
JOB_SUFFIX = ".job.json"

FSYNC_EVERY_LINES = 256
# What results files of earlier versions hold for a job key, and still resume with (the file then
# gains the current value): None for a key they lack (`model_files`, `device`), "auto" for a dtype
# written unresolved.
EARLIER_VALUES: dict[str, str | None] = {"model_files": None, "device": None, "dtype": "auto"}
# The suffixes of `replace_atomically`'s temporary files (`tempfile.mkstemp`: 8 random characters).
TEMPORARY_SUFFIXES = (".tmp", ".retry", ".clean")


def job_file(results: Path) -> Path:
    """Where the job identity of the results file `results` is kept: beside it, or beside its
    target when it is a link (one results file, one job file, whichever path names it)."""
    resolved = Path(results).resolve()
    return resolved.with_name(resolved.name + JOB_SUFFIX)


class OutputError(RuntimeError):
    """The results file cannot be used; the message says why and what to do."""


class ResultsWriteError(OutputError):
    """Writing lines failed (e.g. the disk is full); what is in the file stays valid."""

    def __init__(self, path: Path, cause: OSError) -> None:
        super().__init__(f"writing {path} failed: {cause.strerror or cause}; the lines written so far are kept, "
                         "and the same command resumes once there is room")


class ResultsFile:
    def __init__(self, path: Path, lock_handle, done: dict[int, str | None], job: dict[str, Any], fresh: bool) -> None:
        self.path = path
        self._lock_handle = lock_handle
        self.done = done  # record index -> failure kind (None: answered)
        self.repaired_bytes = 0
        self.dropped_lines = 0
        self.lock_warning: str | None = None  # the file system has no locks: the run is not locked
        self._job = job
        self._fresh = fresh  # `start` empties the file (overwrite, or a new file)
        self._handle = None  # opened by `start`
        self._unsynced = 0
        self._written = 0  # lines this run appended

    # ----------------------------------------------------------------- open
    @classmethod
    def open(cls, path: Path, job: dict[str, Any], overwrite: bool = False) -> ResultsFile:
        """`claim`, then `start`: ready for lines."""
        results = cls.claim(path, job, overwrite)
        try:
            results.start()
        except BaseException:
            results.close()
            raise
        return results

    @classmethod
    def claim(cls, path: Path, job: dict[str, Any], overwrite: bool = False) -> ResultsFile:
        """Lock the file and read the records it holds (none with `overwrite`), refusing another
        job's file; nothing in it changes but the repair of a torn or damaged line."""
        path = Path(path).resolve()  # a link and its target: one lock, and the link is kept
        lock_handle, lock_warning = _acquire_lock(path)
        try:
            if lock_warning is None:  # unlocked, another writer's rewrite may be under way
                _remove_leftover_temporaries(path)
            fresh = overwrite or not path.exists()
            done: dict[int, str | None] = {}
            repaired, dropped = 0, 0
            if not fresh:
                _check_same_job(job_file(path), job, path)
                done, repaired, dropped = _scan_and_repair(path)
        except OSError as exc:  # e.g. the disk is full: every step above leaves the file whole
            lock_handle.close()
            raise _preparing_failed(path, exc) from None
        except BaseException:
            lock_handle.close()
            raise
        results = cls(path, lock_handle, done, job, fresh)
        results.repaired_bytes, results.dropped_lines = repaired, dropped
        results.lock_warning = lock_warning
        return results

    def start(self) -> None:
        """Empty the file where this run starts it afresh, write its job file, open it for lines."""
        if self._handle is not None:
            return
        try:
            if self._fresh:
                write_atomically(self.path, "")
            write_atomically(job_file(self.path), json.dumps(self._job, indent=2, sort_keys=True) + "\n")
            handle = self.path.open("a", encoding="utf-8")
        except OSError as exc:
            raise _preparing_failed(self.path, exc) from None
        self._follow(handle)

    # ---------------------------------------------------------------- write
    def write(self, line: dict[str, Any]) -> None:
        index = int(line["id"])
        if self._handle is None:
            raise OutputError(f"record {index}: {self.path} is not started")  # a bug, never data
        if index in self.done:
            raise OutputError(f"record {index} is already in {self.path}")  # a bug, never data
        try:
            self._handle.write(json.dumps(line, ensure_ascii=False) + "\n")
            self._handle.flush()
            self.done[index] = line.get("failure")
            self._written += 1
            self._unsynced += 1
            if self._unsynced >= FSYNC_EVERY_LINES:
                os.fsync(self._handle.fileno())
                self._unsynced = 0
        except OSError as exc:
            raise ResultsWriteError(self.path, exc) from exc
        if self._unsynced == 0:
            self._check_still_at_path(os.fstat(self._handle.fileno()).st_size)

    def _follow(self, handle) -> None:
        """Append through `handle` from now on, and remember which file it is (`_check_still_at_path`)."""
        self._handle = handle
        opened = os.fstat(handle.fileno())
        self._identity = (opened.st_dev, opened.st_ino)

    def _check_still_at_path(self, size: int) -> None:
        """Raise `OutputError` if `path` no longer names the file being written, `size` bytes long
        (it was deleted, moved or replaced during the run): the lines written would be lost unseen.
        A file of the same size counts as ours: some FUSE mounts report unstable inode numbers."""
        try:
            current = os.stat(self.path)
            moved = (current.st_dev, current.st_ino) != self._identity and current.st_size != size
        except FileNotFoundError:
            moved = True
        if moved:
            raise OutputError(
                f"{self.path} was deleted, moved or replaced during the run, so the {self._written} lines "
                "this run wrote are not in it; run the same command again to redo them"
            )

    def forget(self, indices: set[int]) -> None:
        """Remove the lines of these finished records, so the run does them again (`--retry-failed`).

        Called before this run writes: the file is copied without those lines and the copy
        renamed over it, so a crash leaves either every old line or the copy, never a mix.
        """
        if not indices:
            return

        def copy_other_lines(copy: BinaryIO) -> None:
            with self.path.open("rb") as original:
                for raw in original:
                    if _parse_line(raw)[0] not in indices:
                        copy.write(raw)

        try:
            if self._handle is not None:
                self._handle.flush()
            replace_atomically(self.path, os.stat(self.path).st_mode & 0o777, copy_other_lines, suffix=".retry")
            if self._handle is not None:
                self._handle.close()
                self._follow(self.path.open("a", encoding="utf-8"))
        except OSError as exc:
            raise ResultsWriteError(self.path, exc) from exc
        for index in indices:
            del self.done[index]

    def failure_counts(self) -> Counter:
        return Counter(kind for kind in self.done.values() if kind is not None)

    def close(self) -> None:
        """Flush and fsync, close the file, release the lock. Raises `ResultsWriteError` when the
        last bytes cannot reach the disk (it is full), `OutputError` when the file is no longer at
        its path; the file and the lock are closed all the same."""
        try:
            if self._handle is not None and not self._handle.closed:
                try:
                    try:
                        self._handle.flush()
                        os.fsync(self._handle.fileno())
                        size = os.fstat(self._handle.fileno()).st_size
                    finally:
                        self._handle.close()  # closes the descriptor even when its flush fails (and raises again)
                except OSError as exc:
                    raise ResultsWriteError(self.path, exc) from exc
                self._check_still_at_path(size)
        finally:
            self._lock_handle.close()  # closing the descriptor releases the flock


def _preparing_failed(path: Path, exc: OSError) -> OutputError:
    return OutputError(f"preparing {path} failed: {exc.strerror or exc}; every line in it is kept, "
                       "and the same command resumes once there is room")


def _acquire_lock(path: Path):
    """The open lock file, holding an exclusive flock. Where the file system has no locks (an
    NFS mount without a lock daemon: ENOLCK), the run goes on unlocked and `lock_warning` says so."""
    lock_path = path.with_name(path.name + LOCK_SUFFIX)
    try:
        handle = lock_path.open("a")
    except OSError as exc:
        raise OutputError(f"cannot create the lock file {lock_path}: {exc.strerror}") from None
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise OutputError(
            f"another process is writing {path} (it holds {lock_path}); wait for it or use another --out"
        ) from None
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.ENOTSUP, errno.EOPNOTSUPP):
            handle.close()
            raise OutputError(f"cannot lock {lock_path}: {exc.strerror}") from None
        return handle, (
            f"{lock_path.parent} does not support file locks ({exc.strerror}), so this run is not locked: "
            f"make sure no other process writes {path.name}"
        )
    return handle, None


def _check_same_job(job_path: Path, job: dict[str, Any], path: Path) -> None:
    if not job_path.is_file():
        if path.stat().st_size:
            raise OutputError(
                f"{path} exists and was not written by `vlm-catalog extract` (no {job_path.name}); "
                "use --overwrite to replace it or choose another --out"
            )
        return
    try:
        previous = json.loads(job_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise OutputError(f"{job_path}: unreadable ({exc}); use --overwrite to start afresh") from None
    changed = sorted(
        key for key in set(job) | set(previous)
        if job.get(key) != previous.get(key)
        and not (key in EARLIER_VALUES and previous.get(key) == EARLIER_VALUES[key])
    )
    if changed:
        detail = ", ".join(
            "the model's files changed in place since then" if key == "model_files"
            else f"{key}: {previous.get(key)!r} then, {job.get(key)!r} now"
            for key in changed
        )
        raise OutputError(
            f"{path} holds results of a different job ({detail}); "
            "resume with the same settings, or use --overwrite or another --out"
        )


def _remove_leftover_temporaries(path: Path) -> None:
    """Remove the temporary files a killed rewrite of `path` or of its job file left (the lock is held,
    so no rewrite of them is under way). Only names `replace_atomically` makes match:
    another file's temporaries (`a.jsonl.x` beside `a.jsonl`) do not."""
    leftover = re.compile(
        rf"\.(?:{re.escape(path.name)}|{re.escape(path.name + JOB_SUFFIX)})\.[a-z0-9_]{{8}}"
        rf"(?:{'|'.join(map(re.escape, TEMPORARY_SUFFIXES))})"
    )
    with os.scandir(path.parent) as entries:
        for entry in entries:
            if leftover.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                Path(entry.path).unlink(missing_ok=True)


def _scan_and_repair(path: Path) -> tuple[dict[int, str | None], int, int]:
    """Finished records of an existing file; cut a torn last line; clean damaged ones."""
    done: dict[int, str | None] = {}
    damaged = 0
    end_of_complete = 0
    with path.open("rb") as handle:
        for raw in handle:
            if not raw.endswith(b"\n"):
                break  # the torn last line of a crash
            end_of_complete += len(raw)
            index, failure = _parse_line(raw)
            if index is None or index in done:
                damaged += 1
                continue
            done[index] = failure
    torn = path.stat().st_size - end_of_complete
    if torn:
        os.truncate(path, end_of_complete)  # removes only the bytes after the last newline
    if damaged:
        _rewrite_clean(path)
    return done, torn, damaged


def _parse_line(raw: bytes) -> tuple[int | None, str | None]:
    try:
        line = json.loads(raw)
        return int(line["id"]), line.get("failure")
    except (ValueError, KeyError, TypeError):
        return None, None


def _rewrite_clean(path: Path) -> None:
    def copy_clean_lines(clean: BinaryIO) -> None:
        seen: set[int] = set()
        with path.open("rb") as original:
            for raw in original:
                index, _ = _parse_line(raw)
                if index is not None and index not in seen:
                    seen.add(index)
                    clean.write(raw)

    replace_atomically(path, os.stat(path).st_mode & 0o777, copy_clean_lines, suffix=".clean")
