"""The results file: lock, resume scan, torn last line, damaged lines, job identity, overwrite."""

import errno
import json
import os
import subprocess
import sys

import pytest

from vlm_catalog.batch.output import OutputError, ResultsFile

JOB = {"dataset": "d", "shard": "0/1"}


def line(index: int, failure=None) -> dict:
    return {"id": str(index), "response": "{}", "parsed": None, "finish_reason": "stop", "error": None,
            "metrics": {}, "failure": failure}


def test_lines_are_on_disk_as_soon_as_written_and_resume_skips_them(tmp_path):
    out = tmp_path / "p.jsonl"
    results = ResultsFile.open(out, JOB)
    results.write(line(0))
    results.write(line(3, failure="image"))
    assert [json.loads(raw)["id"] for raw in out.read_text().splitlines()] == ["0", "3"]  # before close
    results.close()
    again = ResultsFile.open(out, JOB)
    assert again.done == {0: None, 3: "image"}
    with pytest.raises(OutputError, match="already in"):
        again.write(line(3))
    again.close()


def test_torn_last_line_is_cut_and_nothing_complete_is_lost(tmp_path):
    out = tmp_path / "p.jsonl"
    results = ResultsFile.open(out, JOB)
    results.write(line(0))
    results.write(line(1))
    results.close()
    complete = out.read_bytes()
    with out.open("ab") as handle:
        handle.write(b'{"id": "2", "response": "{\\"cat')  # a crash mid-line
    resumed = ResultsFile.open(out, JOB)
    assert set(resumed.done) == {0, 1} and resumed.repaired_bytes > 0
    assert out.read_bytes() == complete
    resumed.write(line(2))
    resumed.close()
    assert [json.loads(raw)["id"] for raw in out.read_text().splitlines()] == ["0", "1", "2"]


def test_damaged_and_duplicate_lines_are_dropped_by_a_renamed_clean_copy(tmp_path):
    out = tmp_path / "p.jsonl"
    ResultsFile.open(out, JOB).close()
    out.write_text(json.dumps(line(0)) + "\nnot json\n" + json.dumps(line(0)) + "\n" + json.dumps(line(1)) + "\n")
    resumed = ResultsFile.open(out, JOB)
    resumed.close()
    assert resumed.dropped_lines == 2 and set(resumed.done) == {0, 1}
    assert [json.loads(raw)["id"] for raw in out.read_text().splitlines()] == ["0", "1"]


def test_a_full_disk_at_open_is_an_output_error_and_leaves_the_file_whole(tmp_path, monkeypatch):
    """Resuming on a disk that is still full: the clean copy or the job file cannot be written.
    Either way one OutputError, no temporary file left behind, the lock released, every line kept."""
    import errno

    out = tmp_path / "p.jsonl"
    results = ResultsFile.open(out, JOB)
    results.write(line(0))
    results.close()
    clean = out.read_bytes() + json.dumps(line(1)).encode() + b"\n"
    damaged = clean + b"not json\n"
    real_fsync = os.fsync

    def full_disk_fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    for content in (damaged, clean):  # the clean copy fails, or (nothing to clean) the job file does
        out.write_bytes(content)
        monkeypatch.setattr(os, "fsync", full_disk_fsync)
        with pytest.raises(OutputError, match=r"preparing .*p\.jsonl failed: No space left on device; every line"):
            ResultsFile.open(out, JOB)
        monkeypatch.setattr(os, "fsync", real_fsync)
        assert sorted(path.name for path in tmp_path.iterdir()) == ["p.jsonl", "p.jsonl.job.json", "p.jsonl.lock"]
        assert out.read_bytes() == content
        resumed = ResultsFile.open(out, JOB)  # the lock was released; with room again, it resumes
        resumed.close()
        assert set(resumed.done) == {0, 1} and out.read_bytes() == clean


def test_a_results_file_deleted_or_replaced_during_the_run_is_reported(tmp_path):
    """Lines written to a file no longer at its path would be lost unseen: the check at every
    fsync (each FSYNC_EVERY_LINES lines) and at close says so, naming how many."""
    from vlm_catalog.batch.output import FSYNC_EVERY_LINES

    out = tmp_path / "p.jsonl"
    results = ResultsFile.open(out, JOB)
    results.write(line(0))
    out.unlink()
    results.write(line(1))
    with pytest.raises(OutputError, match=r"p\.jsonl was deleted, moved or replaced during the run, so the 2 lines"):
        results.close()
    assert not out.exists()
    resumed = ResultsFile.open(out, JOB)  # the lock was released; a new run starts a new file
    resumed.write(line(0))
    (tmp_path / "other.jsonl").write_text("")
    os.replace(tmp_path / "other.jsonl", out)  # replaced under the writer
    with pytest.raises(OutputError, match=f"the {FSYNC_EVERY_LINES} lines"):
        for index in range(1, FSYNC_EVERY_LINES + 1):
            resumed.write(line(index))
    with pytest.raises(OutputError):
        resumed.close()
    intact = ResultsFile.open(tmp_path / "q.jsonl", JOB)
    for index in range(FSYNC_EVERY_LINES + 1):
        intact.write(line(index))
    intact.close()  # a file left alone passes both checks
    same = ResultsFile.open(tmp_path / "r.jsonl", JOB)
    same.write(line(0))
    (tmp_path / "copy").write_bytes((tmp_path / "r.jsonl").read_bytes())
    os.replace(tmp_path / "copy", tmp_path / "r.jsonl")  # another inode, the same bytes: as FUSE mounts may report
    same.close()


def test_forgotten_lines_are_removed_and_their_records_can_be_written_again(tmp_path):
    out = tmp_path / "p.jsonl"
    results = ResultsFile.open(out, JOB)
    for index, failure in ((0, None), (1, "engine"), (2, "record"), (3, None)):
        results.write(line(index, failure))
    results.close()
    again = ResultsFile.open(out, JOB)
    again.forget({1, 2})
    assert again.done == {0: None, 3: None}
    assert [json.loads(raw)["id"] for raw in out.read_text().splitlines()] == ["0", "3"]
    again.write(line(2))  # the file was replaced by its copy: the writer follows it
    again.close()  # and does not take the copy for a file replaced behind its back
    assert [json.loads(raw)["id"] for raw in out.read_text().splitlines()] == ["0", "3", "2"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["p.jsonl", "p.jsonl.job.json", "p.jsonl.lock"]


def test_a_second_writer_is_refused_while_the_first_holds_the_lock(tmp_path):
    out = tmp_path / "p.jsonl"
    first = ResultsFile.open(out, JOB)
    with pytest.raises(OutputError, match="another process is writing"):
        ResultsFile.open(out, JOB)
    probe = (
        "import sys, fcntl\n"
        f"handle = open({str(out) + '.lock'!r}, 'a')\n"
        "try:\n    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(7)\n"
    )
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 7  # another process too
    first.close()
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 0
    ResultsFile.open(out, JOB).close()  # released


def test_a_file_system_without_locks_runs_unlocked_with_a_warning(tmp_path, monkeypatch):
    """An NFS mount without a lock daemon answers flock with ENOLCK: before, a traceback, so the
    job could not run there at all. Other lock errors stay one-line refusals."""
    from vlm_catalog.batch import output

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(output.fcntl, "flock", no_locks)
    out = tmp_path / "p.jsonl"
    results = ResultsFile.open(out, JOB)
    assert "does not support file locks (No locks available), so this run is not locked" in results.lock_warning
    results.write(line(0))
    results.close()
    again = ResultsFile.open(out, JOB)
    assert again.done == {0: None}
    again.close()

    def io_error(fd, operation):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(output.fcntl, "flock", io_error)
    with pytest.raises(OutputError, match=r"cannot lock .*p.jsonl.lock: Input/output error"):
        ResultsFile.open(out, JOB)


def test_a_locked_file_has_no_warning(tmp_path):
    results = ResultsFile.open(tmp_path / "p.jsonl", JOB)
    assert results.lock_warning is None
    results.close()


def test_resuming_with_other_settings_or_over_a_foreign_file_is_refused(tmp_path):
    out = tmp_path / "p.jsonl"
    results = ResultsFile.open(out, JOB)
    results.write(line(0))
    results.close()
    with pytest.raises(OutputError, match="different job.*shard"):
        ResultsFile.open(out, {**JOB, "shard": "1/2"})
    foreign = tmp_path / "photo.jpg"
    foreign.write_bytes(b"\xff\xd8\xff not predictions")
    with pytest.raises(OutputError, match="not written by"):
        ResultsFile.open(foreign, JOB)
    assert foreign.read_bytes() == b"\xff\xd8\xff not predictions"


def test_overwrite_replaces_by_rename_never_in_place(tmp_path):
    out = tmp_path / "p.jsonl"
    results = ResultsFile.open(out, JOB)
    results.write(line(0))
    results.close()
    old_inode = os.stat(out).st_ino
    with out.open("rb") as reader:  # a reader of the old file keeps its full content
        fresh = ResultsFile.open(out, {**JOB, "shard": "1/2"}, overwrite=True)
        assert fresh.done == {} and out.read_bytes() == b""
        assert json.loads(reader.read())["id"] == "0"
    fresh.close()
    assert os.stat(out).st_ino != old_inode


def test_a_killed_rewrite_leaves_no_temporary_file_past_the_next_open(tmp_path):
    """kill -9 during a rewrite (overwrite, --retry-failed, the job file, a clean copy) left its hidden
    temporary file in the folder for ever. The next open removes it, and only it: another results
    file's temporaries and files that merely look alike stay."""
    out = tmp_path / "p.jsonl"
    ResultsFile.open(out, JOB).close()
    leftovers = [".p.jsonl.k2x_9abc.tmp", ".p.jsonl.a1b2c3d4.retry", ".p.jsonl.zz11yy22.clean",
                 ".p.jsonl.job.json.q1w2e3r4.tmp"]
    kept = [".p.jsonl.x.a1b2c3d4.tmp",  # the temporary of a results file named p.jsonl.x
            ".p.jsonl.notes", ".p.jsonl.short.tmp", "p.jsonl.a1b2c3d4.tmp", ".other.a1b2c3d4.tmp"]
    for name in leftovers + kept:
        (tmp_path / name).write_text("half a rewrite")
    killed_mid_rewrite = (  # a real one: the process dies (as by kill -9) while it fills the copy
        "import os, sys\nfrom pathlib import Path\nfrom vlm_catalog.atomic_files import replace_atomically\n"
        f"replace_atomically(Path({str(out)!r}), 0o644, lambda handle: (handle.write(b'half'), handle.flush(), "
        "os._exit(9)), suffix='.retry')\n"
    )
    assert subprocess.run([sys.executable, "-c", killed_mid_rewrite]).returncode == 9
    names = {path.name for path in tmp_path.iterdir()}
    assert len(names) == len(leftovers + kept) + 4  # the results, job and lock files and the killed copy
    ResultsFile.open(out, JOB).close()
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        kept + ["p.jsonl", "p.jsonl.job.json", "p.jsonl.lock"]
    )


def test_a_link_and_its_target_are_one_results_file(tmp_path):
    """Before, the lock was taken on the path as given: one run through a symbolic link and another
    through its target both wrote the file, and a rewrite replaced the link by a plain file."""
    target = tmp_path / "real" / "p.jsonl"
    target.parent.mkdir()
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    first = ResultsFile.open(link, JOB)
    with pytest.raises(OutputError, match="another process is writing"):
        ResultsFile.open(target, JOB)
    first.write(line(0))
    first.close()
    resumed = ResultsFile.open(target, JOB)
    assert resumed.done == {0: None}
    resumed.close()
    fresh = ResultsFile.open(link, JOB, overwrite=True)  # a rewrite by rename goes to the target
    fresh.write(line(1))
    fresh.close()
    assert link.is_symlink() and [json.loads(raw)["id"] for raw in target.read_text().splitlines()] == ["1"]
    assert (target.parent / "p.jsonl.job.json").is_file() and not (tmp_path / "link.jsonl.job.json").exists()


def test_an_unlocked_run_leaves_the_temporaries_another_writer_may_be_filling(tmp_path, monkeypatch):
    """Without locks (ENOLCK) nothing says no other process is rewriting: removing its temporary made
    its rename fail."""
    from vlm_catalog.batch import output

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(output.fcntl, "flock", no_locks)
    out = tmp_path / "p.jsonl"
    ResultsFile.open(out, JOB).close()
    in_progress = tmp_path / ".p.jsonl.abcd1234.retry"
    in_progress.write_text("another writer's copy")
    ResultsFile.open(out, JOB).close()
    assert in_progress.read_text() == "another writer's copy"
