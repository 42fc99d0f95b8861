"""What `extract --ray` refuses in one line, before or instead of a Ray traceback or a silent wait
(no Ray instance is started here)."""

import shutil
from types import SimpleNamespace

import pytest

from tests.batch.conftest import FAST
from vlm_catalog.cli import main
from vlm_catalog.paths import DEFAULT_MODEL_DIR

ray = pytest.importorskip("ray")


@pytest.mark.parametrize("asked,on_gpu,resources,alive,expected", [
    (None, False, {"CPU": 8}, 1, 1),  # one replica a node by default
    (None, False, {"CPU": 8}, 3, 3),
    (None, False, {"CPU": 2}, 3, 1),  # a CPU left for the readers
    (3, False, {"CPU": 4}, 1, 3),
    (2, False, {"CPU": 0}, 0, 2),  # --replicas as given: an autoscaling cluster may show nothing yet
    (3, True, {"CPU": 8, "GPU": 2}, 1, 3),
    (None, True, {"CPU": 16, "GPU": 4}, 1, 4),  # one replica a GPU
    (None, True, {"CPU": 3, "GPU": 4}, 1, 2),  # each replica takes a CPU too
])
def test_replicas_leave_a_cpu_for_reading(asked, on_gpu, resources, alive, expected):
    from vlm_catalog.batch.ray_runner import replica_count

    assert replica_count(asked, on_gpu, resources, alive) == expected


@pytest.mark.parametrize("asked,on_gpu,resources,message", [
    (None, False, {"CPU": 1}, "the Ray cluster has 1 CPU(s); a run needs at least 2"),  # waited for ever, silently
    (None, True, {"CPU": 8}, "--device cuda, but the Ray cluster has no GPU"),  # waited for ever too
])
def test_a_cluster_that_cannot_run_the_job_is_refused(asked, on_gpu, resources, message):
    from vlm_catalog.batch.ray_runner import RayRunError, replica_count

    with pytest.raises(RayRunError, match=message.replace("(", r"\(").replace(")", r"\)")):
        replica_count(asked, on_gpu, resources, 1)


def test_the_error_under_rays_wrappers_is_one_line():
    from vlm_catalog.batch.ray_runner import _root_cause

    task_error = SimpleNamespace(cause=ValueError("record 7: bad\nmore"))
    assert _root_cause(task_error) == "ValueError: record 7: bad"
    actor_report = ray.exceptions.RayError("The actor died because of an error raised in its creation task\n"
                                           "  File \"x.py\", line 1\n"
                                           "vlm_catalog.batch.job.BatchError: cannot load the model: cut short\n")
    assert _root_cause(actor_report) == "vlm_catalog.batch.job.BatchError: cannot load the model: cut short"

    class UserCodeException(Exception):  # Ray Data's wrapper of a function's error: its message says nothing
        pass

    data_error = ray.exceptions.RayError("ray::MapBatches(ExtractReplica)\n  File \"x.py\", line 3\n"
                                         "ValueError: CUDA out of memory on device 0\n")
    data_error.cause = UserCodeException("UDF failed to process a data block.")
    assert _root_cause(data_error) == "ValueError: CUDA out of memory on device 0"


def test_a_damaged_model_is_refused_before_ray_starts(small_catalogue, tmp_path, capsys, monkeypatch):
    """Before, each replica failed to load it and the run ended in a dead actor's 235-line report."""
    damaged = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: pytest.fail("Ray was started"))
    code = main(["extract", "--dataset", str(small_catalogue), "--out", str(tmp_path / "p.jsonl"), *FAST,
                 "--model", str(damaged), "--ray"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("error: cannot load the model: ") and "not a readable safetensors file" in err


def test_a_cluster_that_cannot_be_joined_is_one_line(small_catalogue, tmp_path, capsys, monkeypatch):
    """`--ray ray://head:10001` without the ray[client] extra was a traceback."""
    def init(*args, **kwargs):
        raise ValueError("Ray Client requires pip package `ray[client]`.")

    monkeypatch.setattr(ray, "init", init)
    code = main(["extract", "--dataset", str(small_catalogue), "--out", str(tmp_path / "p.jsonl"), *FAST,
                 "--ray", "ray://head:10001"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("error: cannot join the Ray cluster ray://head:10001: Ray Client requires")
