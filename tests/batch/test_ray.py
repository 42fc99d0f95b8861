"""The batch job on a local Ray instance equals the single-process run (needs the [distributed] extra)."""

import signal

import pytest

from tests.batch.conftest import FAST, answers, read_lines
from vlm_catalog.cli import main
from vlm_catalog.signals import StopRequest

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray


def test_ray_run_resumes_a_local_run_with_equal_answers_and_keeps_the_stop_signals(
    small_catalogue, reference_answers, tmp_path, monkeypatch
):
    """The job starts Ray itself (`ray.init`, which installs its own SIGTERM handler: exit at once with
    status 15, the lines in flight lost); the job's handlers must hold while the pipeline runs, so
    SIGTERM stops it between lines with status 130, as without Ray."""
    from vlm_catalog.batch import ray_runner

    handlers_while_running = {}
    real_build_pipeline = ray_runner.build_pipeline

    def build_pipeline(*args, **kwargs):
        handlers_while_running.update({signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)})
        return real_build_pipeline(*args, **kwargs)

    monkeypatch.setattr(ray_runner, "build_pipeline", build_pipeline)
    assert not ray.is_initialized()
    out = tmp_path / "p.jsonl"
    common = ["extract", "--dataset", str(small_catalogue), "--out", str(out), *FAST]
    assert main([*common, "--limit", "3"]) == 0  # in this process
    assert main([*common, "--limit", "7", "--ray", "--window", "2"]) == 0  # the rest on Ray
    ids = [line["id"] for line in read_lines(out)]
    assert sorted(ids, key=int) == [str(i) for i in range(7)]  # exactly once
    assert answers(out) == {key: reference_answers[key] for key in map(str, range(7))}
    assert not ray.is_initialized()  # the job shut down the Ray it started
    assert set(handlers_while_running) == {signal.SIGINT, signal.SIGTERM}
    for handler in handlers_while_running.values():
        assert isinstance(getattr(handler, "__self__", None), StopRequest), handler


def test_a_model_the_replicas_cannot_load_leaves_the_results_file_as_it_was(small_catalogue, tmp_path, capsys):
    """The results file was emptied (`--overwrite`) and its job written once the pipeline was built,
    before any replica had loaded the model; one that did not load (here a preprocessor that cuts
    images otherwise than the tower, refused by the engine, not by the files' check) left 0 lines."""
    import json
    import shutil

    from vlm_catalog.batch.output import JOB_SUFFIX
    from vlm_catalog.paths import DEFAULT_MODEL_DIR

    out = tmp_path / "p.jsonl"
    common = ["extract", "--dataset", str(small_catalogue), "--out", str(out), *FAST, "--limit", "2"]
    assert main(common) == 0
    kept, kept_job = out.read_bytes(), out.with_name(out.name + JOB_SUFFIX).read_bytes()
    model = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, model)
    preprocessor = json.loads((model / "preprocessor_config.json").read_text())
    (model / "preprocessor_config.json").write_text(json.dumps({**preprocessor, "merge_size": 1}))
    capsys.readouterr()
    assert main([*common, "--ray", "--overwrite", "--model", str(model)]) == 1
    assert "merge_size" in capsys.readouterr().err
    assert out.read_bytes() == kept and out.with_name(out.name + JOB_SUFFIX).read_bytes() == kept_job
