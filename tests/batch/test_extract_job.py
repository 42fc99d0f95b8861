"""`vlm-catalog extract` as a batch job: checks before work, resume, shards, kill -9, budget."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.batch.conftest import FAST, answers, read_lines, sample_rows, write_parquet
from vlm_catalog.batch.output import JOB_SUFFIX
from vlm_catalog.cli import main
from vlm_catalog.paths import DEFAULT_MODEL_DIR


def extract(dataset, out, *extra) -> int:
    return main(["extract", "--dataset", str(dataset), "--out", str(out), *FAST, *extra])


def test_argument_and_output_problems_are_found_before_any_work(small_catalogue, tmp_path, capsys):
    out = tmp_path / "p.jsonl"
    not_parquet = tmp_path / "records.csv"
    not_parquet.write_text("a,b\n")
    empty = write_parquet(tmp_path / "empty", [])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    locked_dir = tmp_path / "locked"
    locked_dir.mkdir()
    locked_dir.chmod(0o500)
    cases = {
        "--limit must be a positive": [small_catalogue, out, "--limit", "-1"],
        "--max-tokens must be at least 1": [small_catalogue, out, "--max-tokens", "0"],
        "--shard must look like I/N": [small_catalogue, out, "--shard", "2"],
        "--read-ahead must be 0 or more, got -1": [small_catalogue, out, "--read-ahead", "-1"],
        "is a directory": [small_catalogue, tmp_path],
        # before, a pipe (as /dev/stdout often is) was read to resume from it: a hang
        "results go to a regular file": [small_catalogue, fifo],
        "not to stdout, a pipe or a device": [small_catalogue, "-"],
        # even where stdout is a file: the lock, the job file and the atomic renames would land in /dev
        "results go to a regular file, which": [small_catalogue, "/dev/stdout"],
        "is a file of the dataset": [small_catalogue.parent / "x" / "..", small_catalogue / "data" / "test-00000-of-00001.parquet"],
        "inside the dataset directory": [small_catalogue, small_catalogue / "p.jsonl"],
        "expected a .parquet or .jsonl": [not_parquet, out],
        "has no records": [empty, out],
        "catalogue not found": [tmp_path / "missing", out],
        "not a checkpoint directory": [small_catalogue, out, "--model", str(tmp_path)],
        "gpu_memory_utilization must be in (0, 1], got 2.0": [small_catalogue, out, "--gpu-memory-utilization", "2"],
        # these three were taken silently: ignored, or (0, negative, nan) a log line every record or none
        "--replicas sets a Ray run's engine replicas; add --ray": [small_catalogue, out, "--replicas", "2"],
        "--retry-failed reruns failed records": [small_catalogue, out, "--retry-failed", "--overwrite"],
        "--log-every must be a number of seconds above 0, got 0.0": [small_catalogue, out, "--log-every", "0"],
        "--log-every must be a number of seconds above 0, got nan": [small_catalogue, out, "--log-every", "nan"],
    }
    if os.geteuid() != 0:  # root writes anywhere
        cases["not writable"] = [small_catalogue, locked_dir / "p.jsonl"]
    for message, (dataset, target, *extra) in cases.items():
        if message == "is a file of the dataset":
            dataset = small_catalogue
        code = main(["extract", "--dataset", str(dataset), "--out", str(target), *extra])
        captured = capsys.readouterr()
        assert code == 1, message
        assert message in captured.err and captured.err.count("\n") == 1, captured.err  # one line
        assert "Traceback" not in captured.err
    assert not out.exists()
    assert (small_catalogue / "data" / "test-00000-of-00001.parquet").stat().st_size > 1000


def test_resume_finishes_the_same_answers_and_each_id_once(small_catalogue, reference_answers, tmp_path, capsys):
    out = tmp_path / "p.jsonl"
    assert extract(small_catalogue, out, "--limit", "5", "--window", "2") == 0
    with out.open("ab") as handle:
        handle.write(b'{"id": "5", "respo')  # a torn line, as a crash leaves it
    assert extract(small_catalogue, out, "--window", "3") == 0
    printed = capsys.readouterr().out
    assert "5 already done" in printed and "repaired a torn last line" in printed
    lines = read_lines(out)
    assert sorted(int(line["id"]) for line in lines) == list(range(12))
    assert answers(out) == reference_answers  # batch-invariant: windows 2/3 equal the reference's 64
    assert extract(small_catalogue, out) == 0 and len(read_lines(out)) == 12  # nothing left to do
    assert extract(small_catalogue, out, "--overwrite", "--limit", "2") == 0 and len(read_lines(out)) == 2


def test_shards_together_hold_the_dataset_once_with_the_same_answers(small_catalogue, reference_answers, tmp_path):
    merged: dict[str, str] = {}
    for index in range(3):
        out = tmp_path / f"shard{index}.jsonl"
        assert extract(small_catalogue, out, "--shard", f"{index}/3") == 0
        shard_answers = answers(out)
        assert not set(shard_answers) & set(merged)
        merged.update(shard_answers)
    assert merged == reference_answers


def test_a_short_budget_still_gives_complete_valid_answers(small_catalogue, tmp_path, monkeypatch):
    """--max-tokens 20 cannot even hold the plain answers (about 36 tokens): the bounded
    schema gets them complete, whether chosen at once (a tight budget) or after a cut."""
    import vlm_catalog.structured.catalogue as catalogue_module

    tight, retried = tmp_path / "tight.jsonl", tmp_path / "retried.jsonl"
    arguments = ["extract", "--dataset", str(small_catalogue), "--max-tokens", "20", "--limit", "4"]
    assert main([*arguments, "--out", str(tight)]) == 0
    monkeypatch.setattr(catalogue_module, "TIGHT_BUDGET_MARGIN_TOKENS", -1000)  # never tight: cut, then re-run
    assert main([*arguments, "--out", str(retried)]) == 0
    for line in read_lines(tight) + read_lines(retried):
        assert line["failure"] is None and line["finish_reason"] == "stop"
        assert set(line["parsed"]) == {"category", "brand", "is_secondhand"}
    assert answers(tight) == answers(retried)

    from vlm_catalog import LLM, SamplingParams
    from vlm_catalog.data.loader import load_catalogue

    records = list(load_catalogue(small_catalogue))[:4]
    llm = LLM()
    try:
        results = llm.extract(records, sampling_params=SamplingParams(max_tokens=20))
    finally:
        llm.engine.close()
    assert all(result.ok for result in results)
    assert {result.record_id: result.text for result in results} == answers(tight)


def kill_and_resume(dataset, out, kills: int, seed: int) -> int:
    """SIGKILL the job `kills` times at random points (after 1..3 more finished lines, then a
    random pause: sometimes mid-write), then let it finish; return the kills made."""
    command = [sys.executable, "-m", "vlm_catalog.cli", "extract", "--dataset", str(dataset),
               "--out", str(out), "--window", "2", *FAST]
    rng = random.Random(seed)
    made = 0
    for _ in range(kills):
        done = len(read_lines(out)) if out.exists() else 0
        target = done + rng.randint(1, 3)
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and process.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= target:
                time.sleep(rng.uniform(0.0, 0.3))
                process.send_signal(signal.SIGKILL)
                made += 1
                break
            time.sleep(0.02)
        process.wait()
    finished = subprocess.run(command, capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr
    return made


def test_killed_runs_resume_to_exactly_once_and_equal_answers(small_catalogue, reference_answers, tmp_path):
    out = tmp_path / "p.jsonl"
    assert kill_and_resume(small_catalogue, out, kills=2, seed=11) == 2
    ids = [line["id"] for line in read_lines(out)]
    assert sorted(ids, key=int) == [str(i) for i in range(12)]  # exactly once
    assert answers(out) == reference_answers


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_many_kills_resume_to_exactly_once_and_equal_answers(small_catalogue, reference_answers, tmp_path, seed):
    out = tmp_path / "p.jsonl"
    kill_and_resume(small_catalogue, out, kills=4, seed=seed)
    ids = [line["id"] for line in read_lines(out)]
    assert sorted(ids, key=int) == [str(i) for i in range(12)]
    assert answers(out) == reference_answers


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_ends_cleanly_with_finished_lines_on_disk(tmp_path, stop):
    # all 64 sample records one at a time: on a quiet machine 12 records could finish before the signal
    dataset = write_parquet(tmp_path / "catalogue", sample_rows(64))
    out = tmp_path / "p.jsonl"
    command = [sys.executable, "-m", "vlm_catalog.cli", "extract", "--dataset", str(dataset),
               "--out", str(out), "--window", "1", *FAST]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (out.exists() and out.read_bytes().count(b"\n") >= 2):
        time.sleep(0.02)
    assert process.poll() is None, "the run ended before it could be interrupted"
    process.send_signal(stop)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130
    assert "Traceback" not in err and "interrupted" in err
    lines = read_lines(out)  # every line complete
    assert 2 <= len(lines) < 64


def test_parquet_with_a_wrongly_typed_column_fails_each_record_alone(tmp_path):
    rows = sample_rows(3)
    for row, value in zip(rows, ("no", "yes", "no")):
        row["ground_truth_is_secondhand"] = value
    schema = pq.read_schema(write_parquet(tmp_path / "ok", sample_rows(1)) / "data" / "test-00000-of-00001.parquet")
    schema = schema.set(schema.get_field_index("ground_truth_is_secondhand"), pa.field("ground_truth_is_secondhand", pa.string()))
    dataset = write_parquet(tmp_path / "typed", rows, schema=schema)
    out = tmp_path / "p.jsonl"
    assert extract(dataset, out) == 3
    for line in read_lines(out):
        assert line["failure"] == "record"
        assert "ground_truth_is_secondhand: expected a boolean, got str" in line["error"]


def test_a_full_disk_stops_the_run_with_one_line_and_the_file_resumes(small_catalogue, reference_answers, tmp_path,
                                                                       monkeypatch, capsys):
    import errno

    from vlm_catalog.batch.output import ResultsFile

    out = tmp_path / "p.jsonl"
    real_write = ResultsFile.write
    calls = {"n": 0}

    class FullDisk:
        """The file once the disk is full: every flush fails, close's too."""

        def __init__(self, handle) -> None:
            self.handle = handle
            self.closed = False

        def write(self, text: str) -> None:
            pass  # buffered, never to reach the disk

        def flush(self) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        def fileno(self) -> int:
            return self.handle.fileno()

        def close(self) -> None:  # as a real file does: the descriptor is closed, the flush error raised
            self.closed = True
            self.handle.detach().detach().close()
            self.flush()

    def write_until_full(self, line):
        calls["n"] += 1
        if calls["n"] == 4:  # the disk fills in the middle of the fourth line
            self._handle.write('{"id": "9", "resp')
            self._handle.flush()
            self._handle = FullDisk(self._handle)
        real_write(self, line)

    monkeypatch.setattr(ResultsFile, "write", write_until_full)
    assert extract(small_catalogue, out) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.splitlines()[-1]  # after the start line: the error, one line
    assert last.startswith("error: writing") and "No space left on device" in last and "resumes" in last
    assert len(out.read_text().splitlines()) == 4  # three lines and the cut one
    monkeypatch.setattr(ResultsFile, "write", real_write)
    assert extract(small_catalogue, out) == 0
    assert answers(out) == reference_answers and len(read_lines(out)) == 12


def test_a_results_file_deleted_mid_run_stops_it_with_one_line(small_catalogue, reference_answers, tmp_path,
                                                                monkeypatch, capsys):
    from vlm_catalog.batch.output import ResultsFile

    out = tmp_path / "p.jsonl"
    real_write = ResultsFile.write

    def write_then_delete(self, line):
        real_write(self, line)
        if len(self.done) == 3:
            out.unlink()  # an operator's cleanup script, say

    monkeypatch.setattr(ResultsFile, "write", write_then_delete)
    assert extract(small_catalogue, out) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(f"error: {out} was deleted, moved or replaced during the run, so the 12 lines")
    monkeypatch.setattr(ResultsFile, "write", real_write)
    assert extract(small_catalogue, out) == 0  # the same command redoes them
    assert answers(out) == reference_answers and len(read_lines(out)) == 12


def test_a_dataset_that_goes_away_mid_run_stops_it_with_one_line(small_catalogue, reference_answers, tmp_path,
                                                                   monkeypatch, capsys):
    """An OSError from reading (a lost network mount) is not blamed on the output: one line, and
    the same command resumes."""
    import errno

    from vlm_catalog.data.loader import Catalogue

    real_items = Catalogue.items

    def items_then_gone(self, indices=None):
        for count, item in enumerate(real_items(self, indices)):
            if count == 5:
                raise OSError(errno.ESTALE, "Stale file handle", str(small_catalogue))
            yield item

    out = tmp_path / "p.jsonl"
    monkeypatch.setattr(Catalogue, "items", items_then_gone)
    assert extract(small_catalogue, out) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "writing" not in err
    assert err.splitlines()[-1].startswith("error: the run stopped: [Errno 116] Stale file handle")
    assert err.splitlines()[-1].endswith("the lines written so far are kept, and the same command resumes")
    monkeypatch.setattr(Catalogue, "items", real_items)
    assert extract(small_catalogue, out) == 0
    assert answers(out) == reference_answers and len(read_lines(out)) == 12


def test_a_bug_one_record_meets_fails_that_record_and_the_run_goes_on(small_catalogue, reference_answers, tmp_path,
                                                                       monkeypatch):
    """An unexpected exception preparing record 3 (in a read-ahead thread) or adding record 7 to
    the engine is that record's `engine` failure; before, it stopped the job, and every resume
    stopped at the same record."""
    from vlm_catalog.batch.requests import RequestBuilder
    from vlm_catalog.engine.llm_engine import LLMEngine

    real_params, real_add = RequestBuilder.params, LLMEngine.add_request

    def params(self, record, *args):
        if record.id == "3":
            raise RuntimeError("a bug in preparing")
        return real_params(self, record, *args)

    def add_request(self, prompt, params=None, request_id=None):
        if request_id == "batch-7":
            raise KeyError("a bug in admission")
        return real_add(self, prompt, params, request_id=request_id)

    monkeypatch.setattr(RequestBuilder, "params", params)
    monkeypatch.setattr(LLMEngine, "add_request", add_request)
    out = tmp_path / "p.jsonl"
    assert extract(small_catalogue, out) == 3
    lines = {line["id"]: line for line in read_lines(out)}
    assert sorted(lines, key=int) == [str(i) for i in range(12)]
    assert lines["3"]["failure"] == "engine" and lines["3"]["error"] == "internal error: RuntimeError: a bug in preparing"
    assert lines["7"]["failure"] == "engine" and "internal engine error: KeyError" in lines["7"]["error"]
    assert {i: line["response"] for i, line in lines.items() if i not in ("3", "7")} == {
        i: answer for i, answer in reference_answers.items() if i not in ("3", "7")}


def test_a_damaged_row_group_fails_its_records_and_the_run_goes_on(small_catalogue, reference_answers, tmp_path,
                                                                    capsys):
    """A parquet file with one undecodable row group (rows 4-7): those records fail alone, as
    `record` failures naming the group, and every other record is answered as before."""
    import shutil

    from tests.data.test_loader import _damage_row_group

    dataset = tmp_path / "catalogue"
    shutil.copytree(small_catalogue, dataset)
    _damage_row_group(dataset / "data" / "test-00000-of-00001.parquet", 1)
    out = tmp_path / "p.jsonl"
    assert extract(dataset, out) == 3
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err and "8 answered, 4 failed (record: 4)" in printed.out
    lines = {line["id"]: line for line in read_lines(out)}
    assert sorted(lines, key=int) == [str(i) for i in range(12)]
    for record_id, line in lines.items():
        if 4 <= int(record_id) < 8:
            assert line["failure"] == "record" and "row group 1 cannot be read" in line["error"]
        else:
            assert line["failure"] is None and line["response"] == reference_answers[record_id]


def test_every_input_layout_runs(tmp_path):
    import datasets

    from vlm_catalog.data.format import catalogue_features

    rows = sample_rows(3)
    features = catalogue_features()
    dataset = datasets.Dataset.from_list(rows, features=features)
    dataset.save_to_disk(str(tmp_path / "saved"))
    shopify = tmp_path / "shopify" / "data"
    shopify.mkdir(parents=True)
    datasets.Dataset.from_list(rows[:1], features=features).to_parquet(str(shopify / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_list(rows[1:], features=features).to_parquet(str(shopify / "test-00000-of-00001.parquet"))
    for source in (tmp_path / "saved", tmp_path / "shopify"):
        out = tmp_path / f"{source.name}.jsonl"
        assert extract(source, out, "--limit", "2") == 0
        assert sorted(line["id"] for line in read_lines(out)) == ["0", "1"]
    assert answers(tmp_path / "saved.jsonl") == answers(tmp_path / "shopify.jsonl")  # same records, same order


def test_the_first_signal_stops_at_the_next_check_and_a_second_at_once():
    """The handler raises nothing on the first signal (a raise could land inside a library's
    lock and hang the exit); `check()` raises at the job's safe points; a second signal
    raises where the run is."""
    from vlm_catalog.signals import StopRequest

    previous = signal.getsignal(signal.SIGTERM)
    with StopRequest(second_signal_interrupts=True) as interrupt:
        interrupt.check()  # nothing asked yet
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # bytecodes run: the handler has run by now, and raised nothing
            pass
        assert interrupt.requested == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            interrupt.check()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(100):
                pass
    assert signal.getsignal(signal.SIGTERM) is previous


def test_fp8_runs_are_their_own_jobs(small_catalogue, tmp_path, capsys):
    """--kv-cache-dtype and --quantization reach the engine, and a results file written with
    one value is not resumed with another (the answers may differ); the defaults add nothing."""
    out = tmp_path / "p.jsonl"
    assert extract(small_catalogue, out, "--limit", "2", "--kv-cache-dtype", "fp8", "--quantization", "fp8") == 0
    job = json.loads(out.with_name(out.name + JOB_SUFFIX).read_text())
    assert job["kv_cache_dtype"] == "fp8" and job["quantization"] == "fp8"
    lines = read_lines(out)
    assert len(lines) == 2 and all(line["response"] for line in lines)
    capsys.readouterr()
    assert extract(small_catalogue, out, "--limit", "3", "--kv-cache-dtype", "fp8") == 1
    assert "quantization: 'fp8' then, None now" in capsys.readouterr().err
    assert extract(small_catalogue, out, "--limit", "3", "--kv-cache-dtype", "fp8", "--quantization", "fp8") == 0
    assert len(read_lines(out)) == 3
    plain = tmp_path / "plain.jsonl"
    assert extract(small_catalogue, plain, "--limit", "1") == 0
    assert not {"kv_cache_dtype", "quantization"} & json.loads(plain.with_name(plain.name + JOB_SUFFIX).read_text()).keys()


def test_a_model_changed_in_place_is_another_job(small_catalogue, tmp_path, capsys):
    """Retraining into the same folder keeps --model's path; a resume must still refuse to mix
    two models' answers. A README edit, or a results file from before the check, resumes."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, model)
    out = tmp_path / "p.jsonl"
    assert extract(small_catalogue, out, "--model", str(model), "--limit", "2") == 0
    (model / "README.md").write_text("retrained? no, only notes\n")
    assert extract(small_catalogue, out, "--model", str(model), "--limit", "3") == 0
    job_path = out.with_name(out.name + JOB_SUFFIX)
    job = json.loads(job_path.read_text())
    job.pop("model_files")  # a results file of an earlier version
    job_path.write_text(json.dumps(job))
    assert extract(small_catalogue, out, "--model", str(model), "--limit", "4") == 0
    assert "model_files" in json.loads(job_path.read_text()) and len(read_lines(out)) == 4

    tensors = load_file(model / "model.safetensors")
    name = sorted(tensors)[len(tensors) // 2]
    tensors[name] = tensors[name] * 0.5 + 0.25  # one tensor retrained
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert extract(small_catalogue, out, "--model", str(model), "--limit", "5") == 1
    error = capsys.readouterr().err
    assert "holds results of a different job (the model's files changed in place since then)" in error
    assert len(read_lines(out)) == 4


def test_an_unreadable_model_file_is_one_line(small_catalogue, tmp_path, capsys, monkeypatch):
    from vlm_catalog.batch import job

    def refused(model_dir):  # root reads any file, so the refusal is simulated
        raise PermissionError(13, "Permission denied", str(model_dir / "model.safetensors"))

    monkeypatch.setattr(job, "model_fingerprint", refused)
    assert extract(small_catalogue, tmp_path / "p.jsonl") == 1
    error = capsys.readouterr().err
    assert "cannot read" in error and "model.safetensors (Permission denied)" in error
    assert error.count("\n") == 1 and not (tmp_path / "p.jsonl").exists()


def test_a_file_system_without_locks_runs_with_a_warning(small_catalogue, tmp_path, capsys, monkeypatch):
    from vlm_catalog.batch import output

    def no_locks(fd, operation):  # what flock gives on an NFS mount without a lock daemon
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(output.fcntl, "flock", no_locks)
    out = tmp_path / "p.jsonl"
    assert extract(small_catalogue, out, "--limit", "2") == 0
    error = capsys.readouterr().err
    assert f"warning: {tmp_path} does not support file locks (No locks available), so this run is not locked" in error
    assert len(read_lines(out)) == 2


def test_retry_failed_runs_the_failed_records_again_once_the_data_is_fixed(reference_answers, tmp_path, capsys):
    """The day after a run: two records had no candidates (`record` failures). Their rows are
    fixed in place; `--retry-failed record` removes their lines and runs them again, within the
    run's selection (--limit), each id still once, with the answers of a clean run."""
    rows = sample_rows(6)
    broken = [dict(row) for row in rows]
    for index in (1, 4):
        broken[index]["potential_product_categories"] = []
    dataset = write_parquet(tmp_path / "catalogue", broken)
    out = tmp_path / "p.jsonl"
    assert extract(dataset, out) == 3
    assert {line["id"]: line["failure"] for line in read_lines(out)} == {
        "0": None, "1": "record", "2": None, "3": None, "4": "record", "5": None}
    write_parquet(dataset, rows)  # the data fixed in place
    assert extract(dataset, out) == 3  # a plain resume keeps the failures
    assert extract(dataset, out, "--retry-failed", "engine,length") == 3  # no failure of those kinds
    capsys.readouterr()

    assert extract(dataset, out, "--retry-failed", "record", "--limit", "3") == 0  # the first 3 are all answered
    captured = capsys.readouterr()
    assert "1 of them failed before and run again (record: 1)" in captured.err
    assert "retried 1 failed records (record: 1)" in captured.out
    lines = read_lines(out)
    assert sorted(line["id"] for line in lines) == [str(i) for i in range(6)]
    assert {line["id"]: line["failure"] for line in lines}["4"] == "record"  # outside --limit 3: kept

    assert extract(dataset, out, "--retry-failed") == 0
    assert answers(out) == {key: value for key, value in reference_answers.items() if int(key) < 6}
    assert len(read_lines(out)) == 6

    assert extract(dataset, out, "--retry-failed", "bogus") == 1
    assert "--retry-failed: unknown failure kind 'bogus'; the kinds are image, record" in capsys.readouterr().err


def test_async_scheduling_reaches_the_engine_and_changes_no_answer(small_catalogue, tmp_path, monkeypatch):
    """--async-scheduling: the engine schedules ahead of reading tokens; the answers are the same,
    so a results file written either way resumes either way (it is not part of the job's identity)."""
    from vlm_catalog.engine import llm_engine

    built = []
    real_init = llm_engine.LLMEngine.__init__

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        built.append(self.async_scheduling)  # as the engine resolved it (auto: off on CPU)

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", recording_init)
    plain, pipelined = tmp_path / "plain.jsonl", tmp_path / "pipelined.jsonl"
    assert extract(small_catalogue, plain, "--limit", "3") == 0
    assert extract(small_catalogue, pipelined, "--limit", "3", "--async-scheduling") == 0
    assert built == [False, True]
    assert answers(plain) == answers(pipelined)  # by id: the lines come in the order the answers finish
    assert extract(small_catalogue, pipelined, "--limit", "4") == 0  # resumed without the flag
    assert len(read_lines(pipelined)) == 4


def test_the_warmup_flag_reaches_the_engine_and_changes_no_answer(small_catalogue, tmp_path, monkeypatch):
    from vlm_catalog.engine import llm_engine

    reports = []
    real_init = llm_engine.LLMEngine.__init__

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        reports.append(self.warmup_report)

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", recording_init)
    plain, warmed = tmp_path / "plain.jsonl", tmp_path / "warmed.jsonl"
    assert extract(small_catalogue, plain, "--limit", "2") == 0
    assert extract(small_catalogue, warmed, "--limit", "2", "--warmup", "on") == 0
    assert reports[0] is None and reports[1] is not None and reports[1].num_requests > 0
    assert answers(plain) == answers(warmed)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_job_starts_ends_it_with_status_130_and_nothing_written(small_catalogue, tmp_path, capsys,
                                                                                   monkeypatch, stop):
    """Before, the job caught signals only once records ran: SIGTERM while the dataset opened killed
    the process (status 143), and SIGINT sent to a job a non-interactive shell started in the
    background (which inherits SIGINT ignored) was ignored, so the run went on to the end."""
    from vlm_catalog.data import loader

    def default_action(signum, _frame):
        raise AssertionError(f"{signal.Signals(signum).name} reached the handler the job started with")

    real_load = loader.load_catalogue

    def load_then_signal(*args, **kwargs):
        catalogue = real_load(*args, **kwargs)
        os.kill(os.getpid(), stop)  # e.g. Ctrl-C while a large dataset opens
        return catalogue

    monkeypatch.setattr(loader, "load_catalogue", load_then_signal)
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as inherited from `extract ... &` in a script
    signal.signal(signal.SIGTERM, default_action)  # stands in for SIG_DFL, which would end pytest
    try:
        out = tmp_path / "p.jsonl"
        assert extract(small_catalogue, out, "--limit", "2") == 130
        assert "interrupted before any record was processed" in capsys.readouterr().err
        assert not out.exists()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # the job's handlers are gone again
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_a_run_on_the_cpu_does_not_resume_on_a_gpu(small_catalogue, tmp_path, capsys):
    """The job file said `dtype: auto`, which is float32 on the CPU and bfloat16 on CUDA (where an FP8
    checkpoint's experts also stay FP8), and named no device: a CPU run resumed on a GPU silently,
    mixing two precisions' answers in one file. A file written before the fix (`auto`, no device) resumes."""
    out = tmp_path / "p.jsonl"
    assert extract(small_catalogue, out, "--limit", "1") == 0
    job_path = out.with_name(out.name + JOB_SUFFIX)
    job = json.loads(job_path.read_text())
    assert job["dtype"] == "float32" and job["device"] == "cpu"
    capsys.readouterr()
    assert extract(small_catalogue, out, "--limit", "2", "--device", "cuda") == 1  # refused before any model loads
    error = capsys.readouterr().err
    assert "device: 'cpu' then, 'cuda' now" in error and "dtype: 'float32' then, 'bfloat16' now" in error
    assert extract(small_catalogue, out, "--limit", "2", "--dtype", "bfloat16") == 1
    assert "dtype: 'float32' then, 'bfloat16' now" in capsys.readouterr().err
    assert extract(small_catalogue, out, "--limit", "2", "--dtype", "float32") == 0  # "auto" resolved is the same job
    written_before_the_fix = {key: value for key, value in job.items() if key != "device"} | {"dtype": "auto"}
    job_path.write_text(json.dumps(written_before_the_fix))
    assert extract(small_catalogue, out, "--limit", "3") == 0
    assert json.loads(job_path.read_text())["dtype"] == "float32" and len(read_lines(out)) == 3


def test_a_signal_after_the_last_record_or_while_scoring_is_an_interruption(small_catalogue, tmp_path, capsys,
                                                                            monkeypatch):
    """The job's handler now covers the whole run: a SIGTERM after the last record was recorded and
    ignored (exit 0, scored anyway), and a second Ctrl-C while --eval scored said "interrupted before any
    record was processed". Both are an interruption with every record on disk."""
    from vlm_catalog.batch import job

    out = tmp_path / "p.jsonl"
    real_close = job.Progress.close

    def close_then_sigterm(self):
        real_close(self)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(job.Progress, "close", close_then_sigterm)
    assert extract(small_catalogue, out, "--limit", "2", "--eval") == 130
    assert "interrupted: " in capsys.readouterr().err and len(read_lines(out)) == 2
    monkeypatch.setattr(job.Progress, "close", real_close)

    def scoring_interrupted(*args):
        raise KeyboardInterrupt  # the second signal's at-once interrupt, while scoring

    monkeypatch.setattr(job, "evaluate_results", scoring_interrupted)
    assert extract(small_catalogue, out, "--limit", "3", "--eval") == 130
    err = capsys.readouterr().err
    assert "interrupted: " in err and "before any record" not in err and len(read_lines(out)) == 3


def test_a_start_refused_once_the_file_is_claimed_changes_nothing_in_it(small_catalogue, tmp_path, capsys):
    """The results file was emptied (`--overwrite`) and its job written before the model loaded: a
    model that then did not load (here `--device cuda` on a machine without one) left 0 of the earlier
    lines, and on a new path a job file of the refused settings, which the corrected command was
    refused by."""
    out = tmp_path / "p.jsonl"
    assert extract(small_catalogue, out, "--limit", "2") == 0
    job_path = out.with_name(out.name + JOB_SUFFIX)
    kept, kept_job = out.read_text(), job_path.read_text()
    capsys.readouterr()
    assert extract(small_catalogue, out, "--overwrite", "--device", "cuda", "--dtype", "float32") == 1
    assert "cannot load the model" in capsys.readouterr().err
    assert out.read_text() == kept and job_path.read_text() == kept_job

    new = tmp_path / "new.jsonl"
    assert extract(small_catalogue, new, "--limit", "1", "--device", "cuda", "--dtype", "float32") == 1
    assert not new.exists() and not new.with_name(new.name + JOB_SUFFIX).exists()
    assert extract(small_catalogue, new, "--limit", "1") == 0  # the corrected command runs
    assert len(read_lines(new)) == 1


def test_an_out_inside_the_model_directory_is_refused(small_catalogue, tmp_path, capsys):
    """`--out MODEL/config.json --overwrite` emptied the checkpoint's config (its results file renamed
    over it)."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, model)
    config = (model / "config.json").read_bytes()
    for out in (model / "config.json", model / "predictions.jsonl"):
        assert extract(small_catalogue, out, "--model", str(model), "--overwrite") == 1
        assert f"--out {out} lies inside the model directory {model}" in capsys.readouterr().err
    assert (model / "config.json").read_bytes() == config and not (model / "predictions.jsonl").exists()


def test_retry_failed_keeps_the_failed_lines_until_the_model_has_loaded(tmp_path, capsys, monkeypatch):
    """`--retry-failed` removed the failed lines before the model loaded: a model that then did not
    load (here: out of memory) left the records without their lines and their errors (the next run
    did them again, but what had gone wrong was lost)."""
    from vlm_catalog.batch import job
    rows = sample_rows(3)
    rows[1]["potential_product_categories"] = []
    dataset = write_parquet(tmp_path / "catalogue", rows)
    out = tmp_path / "p.jsonl"
    assert extract(dataset, out) == 3
    kept = out.read_text()
    capsys.readouterr()
    real_build_engine = job.build_engine

    def out_of_memory(settings):
        raise job.BatchError("cannot load the model: CUDA out of memory")

    monkeypatch.setattr(job, "build_engine", out_of_memory)
    assert extract(dataset, out, "--retry-failed", "record") == 1
    assert "cannot load the model: CUDA out of memory" in capsys.readouterr().err
    assert out.read_text() == kept
    monkeypatch.setattr(job, "build_engine", real_build_engine)
    assert extract(dataset, out, "--retry-failed", "record") == 3  # the data still has no candidates
    lines = read_lines(out)
    assert sorted(line["id"] for line in lines) == ["0", "1", "2"]
    assert {line["id"]: line["failure"] for line in lines}["1"] == "record"
    assert "retried 1 failed records (record: 1)" in capsys.readouterr().out
