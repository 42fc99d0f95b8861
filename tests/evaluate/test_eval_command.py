"""`vlm-catalog eval` end to end on a handmade catalogue."""

import json

from vlm_catalog.cli import main
from vlm_catalog.paths import SAMPLE_CATALOGUE_DIR


def test_eval_jsonl_writes_the_benchmark_keys(handmade_catalogue, tmp_path, capsys):
    predictions = tmp_path / "p.jsonl"
    lines = [
        {"id": "0", "response": json.dumps({"category": "Animals & Pet Supplies > Pet Supplies > Bird Supplies > Bird Cage Accessories", "brand": "acme", "is_secondhand": False})},
        {"id": 1, "response": "I think it is a shirt"},
        {"id": "2", "response": json.dumps({"category": "Home & Garden > Decor", "brand": "Lumo", "is_secondhand": False})},
    ]
    predictions.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "report.json"
    assert main(["eval", "--predictions", str(predictions), "--dataset", str(handmade_catalogue), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["num_unparsable"] == 1
    # common 4 + 0 + 1 = 5 over predicted 4 + 3 (padded to the truth's depth) + 2 and true 4 + 3 + 3
    precision, recall = 5 / 9, 5 / 10
    assert abs(report["category_hf1"] - 2 * precision * recall / (precision + recall)) < 1e-12
    assert abs(report["brand_accuracy"] - 2 / 3) < 1e-12
    for key in ("category_hf1", "brand_accuracy", "is_secondhand_f1", "num_unparsable"):
        assert key in report
    assert "category hF1" in capsys.readouterr().out


def test_eval_mlperf_log(handmade_catalogue, tmp_path):
    log = tmp_path / "mlperf_log_accuracy.json"
    answer = json.dumps({"category": "Home & Garden > Lighting > Lamps", "brand": "Lumo", "is_secondhand": False})
    log.write_text(json.dumps([{"seq_id": 0, "qsl_idx": 2, "data": answer.encode().hex()}]))
    out = tmp_path / "r.json"
    assert main(["eval", "--predictions", str(log), "--dataset", str(handmade_catalogue), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["category_hf1"] == 1.0


def test_eval_says_what_the_score_covers(handmade_catalogue, tmp_path, capsys):
    """An MLPerf log may answer a record twice (scored twice, as the reference does) and a shard's
    predictions answer only some records: the output says so, where before it gave only a count."""
    log = tmp_path / "mlperf_log_accuracy.json"
    answer = json.dumps({"category": "Home & Garden > Lighting > Lamps", "brand": "Lumo", "is_secondhand": False})
    entries = [(0, 2, answer), (1, 2, "garbage")]
    log.write_text(json.dumps([{"seq_id": s, "qsl_idx": i, "data": a.encode().hex()} for s, i, a in entries]))
    assert main(["eval", "--predictions", str(log), "--dataset", str(handmade_catalogue)]) == 0
    out = capsys.readouterr().out
    assert "samples: 2   unparsable responses: 1" in out
    assert "note: 2 answers for 1 records (1 repeat a record's)" in out
    assert "note: the predictions answer 1 of the catalogue's 3 records" in out

    everything = tmp_path / "p.jsonl"
    everything.write_text("".join(json.dumps({"id": i, "response": answer}) + "\n" for i in range(3)))
    assert main(["eval", "--predictions", str(everything), "--dataset", str(handmade_catalogue)]) == 0
    assert "note:" not in capsys.readouterr().out


def test_eval_unknown_ids_fail_clearly(handmade_catalogue, tmp_path, capsys):
    predictions = tmp_path / "p.jsonl"
    predictions.write_text('{"id": "7", "response": "{}"}\n{"id": "abc", "response": "{}"}\n')
    assert main(["eval", "--predictions", str(predictions), "--dataset", str(handmade_catalogue)]) == 2
    err = capsys.readouterr().err
    assert "2 prediction id(s) match no record" in err and "'7'" in err and "'abc'" in err


def test_a_report_path_that_cannot_be_written_is_one_line(handmade_catalogue, tmp_path, capsys):
    """Checked before scoring (a folder; a folder that cannot be made), or named when the write
    fails (/dev/full: a full disk). Before, each was a traceback after the scores."""
    predictions = tmp_path / "p.jsonl"
    predictions.write_text('{"id": "0", "response": "{}"}\n')
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    cases = {
        str(tmp_path): "is a folder; give a file name such as",
        str(a_file / "r.json"): f"cannot write into its folder {a_file} (Not a directory)",
        "/dev/full": "--json /dev/full: cannot write it (No space left on device)",
    }
    for target, message in cases.items():
        code = main(["eval", "--predictions", str(predictions), "--dataset", str(handmade_catalogue), "--json", target])
        captured = capsys.readouterr()
        assert code == 2 and message in captured.err and captured.err.count("\n") == 1, captured.err
        assert ("hF1" in captured.out) == (target == "/dev/full")  # the scores print before the write
    nested = tmp_path / "new" / "folder" / "r.json"
    assert main(["eval", "--predictions", str(predictions), "--dataset", str(handmade_catalogue), "--json", str(nested)]) == 0
    assert json.loads(nested.read_text())["num_unparsable"] == 1


def test_eval_is_strict_only_about_the_records_it_scores(tmp_path, capsys):
    """A shard's predictions, scored on a catalogue whose damaged labels lie in another shard: before,
    exit 2 naming a record the predictions never mention."""
    from tests.batch.conftest import sample_rows, write_parquet
    from tests.data.test_loader import _damage_row_group

    rows = sample_rows(12)
    directory = write_parquet(tmp_path / "catalogue", rows, row_group_size=4)
    _damage_row_group(directory / "data" / "test-00000-of-00001.parquet", 2, column="ground_truth_category")
    predictions = tmp_path / "p.jsonl"
    answer = {"category": rows[0]["ground_truth_category"], "brand": rows[0]["ground_truth_brand"], "is_secondhand": False}
    predictions.write_text(json.dumps({"id": 0, "response": json.dumps(answer)}) + "\n")
    assert main(["eval", "--predictions", str(predictions), "--dataset", str(directory)]) == 0
    assert "samples: 1" in capsys.readouterr().out
    with predictions.open("a") as handle:
        handle.write(json.dumps({"id": 10, "response": "{}"}) + "\n")
    assert main(["eval", "--predictions", str(predictions), "--dataset", str(directory)]) == 2
    assert "record 10: " in capsys.readouterr().err


def test_predictions_of_one_split_are_not_scored_against_another(tmp_path, capsys):
    """`extract --split test` writes ids that are rows of the test split; `eval` without `--split`
    would meet the train split's labels at those ids and score silently wrong. The job file beside
    the predictions says which rows they are."""
    from tests.conftest import handmade_rows, write_catalogue

    rows = handmade_rows()
    write_catalogue(tmp_path / "shop", rows[:2], split="train")
    write_catalogue(tmp_path / "shop", rows[2:], split="test")
    out = tmp_path / "p.jsonl"
    dataset = str(tmp_path / "shop")
    assert main(["extract", "--dataset", dataset, "--split", "test", "--out", str(out), "--max-tokens", "60"]) == 0
    capsys.readouterr()
    assert main(["eval", "--predictions", str(out), "--dataset", dataset]) == 2
    error = capsys.readouterr().err
    assert "was made with --split test (p.jsonl.job.json)" in error and "not all splits" in error
    link = tmp_path / "elsewhere" / "link.jsonl"  # extract keeps the job file beside a link's target
    link.parent.mkdir()
    link.symlink_to(out)
    assert main(["eval", "--predictions", str(link), "--dataset", dataset]) == 2
    assert "was made with --split test (p.jsonl.job.json)" in capsys.readouterr().err
    assert main(["eval", "--predictions", str(out), "--dataset", dataset, "--split", "test"]) == 0
    assert "samples: 1" in capsys.readouterr().out
    # answers in one schema scored with another all failed to parse: every one "unparsable"
    assert main(["eval", "--predictions", str(out), "--dataset", dataset, "--split", "test",
                 "--schema", "product_details"]) == 2
    assert capsys.readouterr().err == (f"error: {out} holds answers in the 'product_metadata' schema "
                                       "(p.jsonl.job.json); score them with --schema product_metadata, "
                                       "not product_details\n")
    assert main(["eval", "--predictions", str(out), "--dataset", dataset, "--seed", "-1"]) == 2
    assert capsys.readouterr().err == "error: --seed must be 0 or more, got -1\n"

    job_file = tmp_path / "p.jsonl.job.json"
    job = json.loads(job_file.read_text())
    job_file.write_text(json.dumps({**job, "num_records": 5}))  # as if the catalogue had changed since
    assert main(["eval", "--predictions", str(out), "--dataset", dataset, "--split", "test"]) == 2
    assert "made on a catalogue of 5 records (p.jsonl.job.json); this one has 1" in capsys.readouterr().err
    job_file.write_text("not json")  # a job file that cannot be read checks nothing
    assert main(["eval", "--predictions", str(out), "--dataset", dataset, "--split", "test"]) == 0


def test_a_report_over_the_predictions_or_their_job_file_is_refused(tmp_path, capsys):
    """`--json` given the predictions file (or its job file) replaced it with the report, exit 0."""
    from vlm_catalog.batch.output import job_file

    out = tmp_path / "p.jsonl"
    assert main(["extract", "--dataset", str(SAMPLE_CATALOGUE_DIR), "--out", str(out), "--limit", "2",
                 "--max-tokens", "40"]) == 0
    kept = {path: path.read_bytes() for path in (out, job_file(out))}
    for target in kept:
        capsys.readouterr()
        assert main(["eval", "--predictions", str(out), "--dataset", str(SAMPLE_CATALOGUE_DIR), "--json", str(target)]) == 2
        err = capsys.readouterr().err
        assert err == f"error: --json {target} would replace {target}, an input of this run; choose another path\n"
    assert all(path.read_bytes() == content for path, content in kept.items())


def test_an_unreadable_predictions_file_is_one_line(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    predictions = tmp_path / "p.jsonl"
    predictions.write_text('{"id": 0, "response": "{}"}\n')
    real_open = Path.open

    def refused(self, *args, **kwargs):  # root reads any file, so the refusal is simulated
        if self == predictions:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refused)
    assert main(["eval", "--predictions", str(predictions), "--dataset", str(SAMPLE_CATALOGUE_DIR)]) == 2
    assert capsys.readouterr().err == f"error: {predictions}: cannot read it (Permission denied)\n"
