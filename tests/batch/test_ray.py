"""The batch job on a local Ray instance equals the single-process run (needs the [distributed] extra)."""

import pytest

from tests.batch.conftest import FAST, answers, read_lines
from vlm_catalog.cli import main

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_run_resumes_a_local_run_with_equal_answers(local_ray, small_catalogue, reference_answers, tmp_path):
    out = tmp_path / "p.jsonl"
    common = ["extract", "--dataset", str(small_catalogue), "--out", str(out), *FAST]
    assert main([*common, "--limit", "3"]) == 0  # in this process
    assert main([*common, "--limit", "7", "--ray", "--window", "2"]) == 0  # the rest on Ray
    ids = [line["id"] for line in read_lines(out)]
    assert sorted(ids, key=int) == [str(i) for i in range(7)]  # exactly once
    assert answers(out) == {key: reference_answers[key] for key in map(str, range(7))}
