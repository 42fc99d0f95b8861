"""scripts/gpu_session.py: a device call's steps run in order inside a budget; a step over its
limit is stopped with its children, one that cannot get its minimum is skipped; the plans name
phases, options and markers that exist."""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def session():
    return load_script("gpu_session")


def python_step(session, name: str, code: str, max_s: float = 30, min_s: float = 0, **options):
    return session.Step(name, (sys.executable, "-c", code), max_s=max_s, min_s=min_s, **options)


def test_steps_run_in_order_with_status_log_and_tail(session, tmp_path):
    steps = [
        python_step(session, "first", "print('one'); print('two'); print('three')", tail_to="first.txt", tail_lines=2),
        python_step(session, "fails", "import sys; print('bad'); sys.exit(3)"),
        python_step(session, "writes", "import sys; open(sys.argv[1], 'w').write('x')"),
    ]
    steps[2] = session.Step("writes", (*steps[2].argv, "{out}/made.txt"), max_s=30, min_s=0)
    results = session.run_plan(steps, budget_s=120, out=tmp_path)
    assert [(r.name, r.status, r.returncode) for r in results] == [("first", "ok", 0), ("fails", "failed", 3),
                                                                   ("writes", "ok", 0)]
    assert (tmp_path / "first.txt").read_text() == "two\nthree\n"
    assert (tmp_path / "made.txt").read_text() == "x"
    log = (tmp_path / "session.log").read_text()
    assert log.index("===== first") < log.index("one") < log.index("===== fails") < log.index("bad")
    recorded = json.loads((tmp_path / "session.json").read_text())
    assert [r["status"] for r in recorded] == ["ok", "failed", "ok"]


def test_a_step_past_its_limit_is_stopped_with_its_children_and_the_next_runs(session, tmp_path):
    marker = tmp_path / "child_survived"
    child = tmp_path / "child.py"  # would write the marker after 4 s
    child.write_text(f"import time\ntime.sleep(4)\nopen({str(marker)!r}, 'w').close()\n")
    code = ("import subprocess, sys, time; print('started', flush=True); "
            f"subprocess.Popen([sys.executable, {str(child)!r}]); time.sleep(60)")
    steps = [python_step(session, "hangs", code, max_s=2, tail_to="hangs.txt"), python_step(session, "next", "pass")]
    started = time.monotonic()
    results = session.run_plan(steps, budget_s=60, out=tmp_path)
    assert time.monotonic() - started < 20
    assert [r.status for r in results] == ["timeout", "ok"]
    assert results[0].seconds < 15 and results[0].limit_s == 2
    tail = (tmp_path / "hangs.txt").read_text()  # what it printed before it was stopped, then its traceback
    assert tail.startswith("started\n") and tail.rstrip().endswith("KeyboardInterrupt")
    time.sleep(4)
    assert not marker.exists(), "the stopped step's child ran on"


def test_a_step_stopped_at_its_limit_gets_sigint_first_and_can_print_its_summary(session, tmp_path):
    """pytest prints its summary of the tests that ran on SIGINT: stopping a step must let it."""
    code = ("import time\nprint('running', flush=True)\ntry:\n    time.sleep(60)\n"
            "except KeyboardInterrupt:\n    print('1 passed, interrupted', flush=True)\n    raise SystemExit(2)\n")
    results = session.run_plan([python_step(session, "interrupted", code, max_s=2, tail_to="tail.txt")],
                               budget_s=30, out=tmp_path)
    assert results[0].status == "timeout" and results[0].returncode == 2
    assert (tmp_path / "tail.txt").read_text() == "running\n1 passed, interrupted\n"


def test_a_step_that_ignores_sigint_is_still_stopped(session, tmp_path, monkeypatch):
    monkeypatch.setattr(session, "STOP_SIGNALS", ((session.signal.SIGINT, 1.0), (session.signal.SIGTERM, 1.0),
                                                  (session.signal.SIGKILL, None)))
    code = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    started = time.monotonic()
    results = session.run_plan([python_step(session, "stubborn", code, max_s=1)], budget_s=30, out=tmp_path)
    assert results[0].status == "timeout" and results[0].returncode == -session.signal.SIGTERM
    assert time.monotonic() - started < 10


def test_optional_options_are_added_only_where_their_module_is_importable(session, tmp_path):
    """The pytest step's xdist and timeout options need plugins the GPU image may lack (carried
    in .whl): with the module there the options are passed, without it the step runs without."""
    code = "import sys; print(sys.argv[1:])"
    step = session.Step("args", (sys.executable, "-c", code), max_s=30, min_s=0, tail_to="args.txt",
                        optional=(("json", ("--with-json",)), ("no_such_module_here", ("-n", "4"))))
    results = session.run_plan([step], budget_s=60, out=tmp_path)
    assert results[0].status == "ok" and results[0].command[-1] == "--with-json"
    assert (tmp_path / "args.txt").read_text() == "['--with-json']\n"
    assert "no_such_module_here is not importable, running without -n 4" in (tmp_path / "session.log").read_text()
    assert session.importable("xdist", dict(session.os.environ))  # the dev extra's, as on the GPU with .whl


def test_a_silent_step_is_stopped_too(session, tmp_path):
    results = session.run_plan([python_step(session, "silent", "import time; time.sleep(60)", max_s=1.5)],
                               budget_s=30, out=tmp_path)
    assert results[0].status == "timeout" and results[0].seconds < 15


def test_sigint_stops_a_step_even_where_the_session_was_started_with_it_ignored(session, tmp_path):
    """A shell's background job (`nohup ... &`) starts with SIGINT ignored, which its children
    inherit: a step would then run on through SIGINT's whole grace (15 s) until SIGTERM."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        results = session.run_plan([python_step(session, "sleeps", "import time; time.sleep(60)", max_s=1.5)],
                                   budget_s=30, out=tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert results[0].status == "timeout" and results[0].seconds < 10
    assert "KeyboardInterrupt" in (tmp_path / "session.log").read_text()


def test_steps_never_run_past_the_budget_and_skip_below_their_minimum(session, tmp_path):
    steps = [
        python_step(session, "long", "import time; time.sleep(60)", max_s=100),
        python_step(session, "needs_time", "pass", min_s=5),
    ]
    results = session.run_plan(steps, budget_s=2, out=tmp_path)
    assert results[0].status == "timeout" and results[0].limit_s <= 2
    assert results[1].status == "skipped" and results[1].returncode is None


def test_plans_name_what_exists(session):
    """Every bench_gpu phase and bench_kernels option a plan uses exists; pytest's gpu marker is declared."""
    bench_gpu = load_script("bench_gpu")
    kernel_options = (REPO_ROOT / "scripts" / "bench_kernels.py").read_text()
    bench_gpu_options = (REPO_ROOT / "scripts" / "bench_gpu.py").read_text()
    markers = (REPO_ROOT / "pyproject.toml").read_text()
    assert '"gpu: ' in markers
    for plan in session.PLANS.values():
        for step in plan:
            assert 0 < step.min_s <= step.max_s < 600, step
            argv = list(step.argv)
            if "scripts/bench_gpu.py" in argv:
                phases = argv[argv.index("--phases") + 1].split(",")
                assert set(phases) <= set(bench_gpu.PHASES), phases
                for option in (a for a in argv if a.startswith("--")):
                    assert f'"{option}"' in bench_gpu_options, option
            elif "scripts/bench_kernels.py" in argv:
                for option in (a for a in argv if a.startswith("--")):
                    assert f'"{option}"' in kernel_options, option
            else:
                assert argv[:3] == ["python3", "-m", "pytest"] and "gpu" in argv, argv
    record = [step.name for step in session.PLANS["record"]]
    assert record[0] == "pytest_gpu"  # the correctness check first: the engine numbers mean little without it
    # then the targets (the engine, the decode step, constrained decoding), before the
    # profile and the candidate engines: a call of about 560 s does not reach its last steps
    targets = max(record.index(name) for name in ("engines", "roofline", "constrained"))
    assert targets < min(record.index(name) for name in ("engine_profile", "engine_steps_32k", "engine_fast"))


def test_plans_that_would_write_too_many_files_pack_them(session):
    """session.json, session.log, the steps' tails and the `{out}/...` files: the record and tune
    plans stay within the 8 files a device call brings back (one more in the tune plan once went
    unnoticed), and the decode plan, which would not, packs them."""
    written = {name: session.written_files(plan) for name, plan in session.PLANS.items()}
    assert len(written["tune"]) <= session.FILES_BACK and not session.packs_results(session.PLANS["tune"])
    assert len(written["record"]) <= session.FILES_BACK and not session.packs_results(session.PLANS["record"])
    assert len(written["decode"]) > session.FILES_BACK and session.packs_results(session.PLANS["decode"])
    assert "tuned_configs.json" in written["tune"] and "pytest_gpu.txt" in written["record"]


def test_packed_files_come_back_in_one_archive_and_a_file_a_later_step_merges_into_waits(session, tmp_path,
                                                                                        monkeypatch):
    import tarfile

    monkeypatch.setattr(session, "FILES_BACK", 3)  # session.json, session.log and one more
    write = "import sys; [open(path, 'a').write(sys.argv[1]) for path in sys.argv[2:]]"
    steps = [session.Step("first", ("python3", "-c", write, "1", "{out}/a.json", "{out}/shared.json"),
                          max_s=30, min_s=0, tail_to="first.txt"),
             session.Step("second", ("python3", "-c", write, "2", "{out}/b.json", "{out}/shared.json"),
                          max_s=30, min_s=0)]
    session.run_plan(steps, budget_s=120, out=tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["results.tar", "session.json", "session.log"]
    with tarfile.open(tmp_path / "results.tar") as archive:
        members = {member.name: archive.extractfile(member).read().decode() for member in archive.getmembers()}
    # shared.json stayed in place for the second step, then went in once, with both steps' writes
    assert members == {"a.json": "1", "first.txt": "", "b.json": "2", "shared.json": "12"}
    assert "first: a.json, first.txt moved into results.tar" in (tmp_path / "session.log").read_text()


def test_the_smoke_plan_merges_both_engine_phases_into_one_json(session, tmp_path, capsys):
    """The CPU plan end to end through main(): bench_gpu.py runs twice, each writing its phase into
    the output folder's bench_gpu.json; the summary says both steps passed."""
    assert session.main(["--plan", "smoke", "--budget", "280", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench_gpu.json").read_text())
    for phase in ("engine", "engine_fp8"):
        assert results[phase]["fixed_150_tokens"]["errors"] == 0, results[phase]
        assert results[phase]["fixed_150_tokens"]["generated_tokens"] == 8  # 2 records x 4 tokens
    assert [(r["name"], r["status"]) for r in json.loads((tmp_path / "session.json").read_text())] == [
        ("engine", "ok"), ("engine_fp8", "ok")]
    assert "engine_fp8:" in (tmp_path / "session.log").read_text()


def test_dry_run_prints_the_plan(session, capsys):
    assert session.main(["--plan", "record", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    for step in session.PLANS["record"]:
        assert f"{step.name}: {shlex.join(step.argv)}" in printed
    assert "[-n 4 --dist loadgroup where xdist is importable]" in printed
    assert session.main(["--plan", "tune", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "--per-channel --buckets 4096 16384 256 1 --write-table '{out}/tuned_configs.json' " \
           "[with VLM_CATALOG_FP8_FAST_ACCUMULATION=1]" in printed
    # the tuners write one table, which the engine step then runs with
    tune = {step.name: step.argv for step in session.PLANS["tune"]}
    assert tune["tune_moe_w8a8"][-2:] == tune["tune_decode_fp8"][-2:] == tune["tune_decode_bf16"][-2:] == (
        "--write-table", "{out}/tuned_configs.json")
    assert "--fp8" not in tune["tune_decode_bf16"]  # the bf16 cache, the kernel rows' comparison with SDPA
    engine = tune["engine_tuned"]
    assert "engine_w8a8_channel_tuned" in engine[engine.index("--phases") + 1]
    assert engine[engine.index("--tuned-configs") + 1] == "{out}/tuned_configs.json"


def test_a_steps_variables_reach_its_process_alone(session, tmp_path):
    code = "import os; print(os.environ.get('VLM_CATALOG_FP8_FAST_ACCUMULATION'))"
    steps = [python_step(session, "with", code, tail_to="with.txt", env=(("VLM_CATALOG_FP8_FAST_ACCUMULATION", "1"),)),
             python_step(session, "without", code, tail_to="without.txt")]
    session.run_plan(steps, budget_s=60, out=tmp_path)
    assert (tmp_path / "with.txt").read_text().split() == ["1"]
    assert (tmp_path / "without.txt").read_text().split() == ["None"]


def test_a_fast_path_that_fails_its_gpu_test_is_off_in_the_later_steps(session, tmp_path, capsys):
    """The pytest step's failed fast paths (tests/conftest.py writes their names into the file the
    session names) join VLM_CATALOG_KERNELS_OFF for every later step, beside what it already said;
    a step's own setting replaces the session's for it, with the failed ones still added (before,
    a step comparing variants ran a fast path that had failed), and session.json says what each
    step ran with."""
    fail = ("import os; open(os.environ['VLM_CATALOG_FAILED_FAST_PATHS'], 'a')"
            ".write('skinny_linear\\ttests/a.py::test_gpu_a\\ndecode_merge_in_place\\nskinny_linear\\n')")
    show = "import os; print(os.environ['VLM_CATALOG_KERNELS_OFF'])"
    steps = [python_step(session, "pytest_gpu", fail),
             python_step(session, "after", show, tail_to="after.txt"),
             python_step(session, "own", show, tail_to="own.txt", env=(("VLM_CATALOG_KERNELS_OFF", "fused_moe"),))]
    results = session.run_plan(steps, budget_s=60, out=tmp_path, env={"VLM_CATALOG_KERNELS_OFF": "fp8_widen_ptx"})
    assert (tmp_path / "after.txt").read_text().split() == ["fp8_widen_ptx,skinny_linear,decode_merge_in_place"]
    assert (tmp_path / "own.txt").read_text().split() == ["fused_moe,skinny_linear,decode_merge_in_place"]
    assert [r.kernels_off for r in results] == [["fp8_widen_ptx"],
                                                ["fp8_widen_ptx", "skinny_linear", "decode_merge_in_place"],
                                                ["fused_moe", "skinny_linear", "decode_merge_in_place"]]
    recorded = json.loads((tmp_path / "session.json").read_text())
    assert recorded[1]["kernels_off"] == ["fp8_widen_ptx", "skinny_linear", "decode_merge_in_place"]
    log = (tmp_path / "session.log").read_text()
    assert log.count("failed its GPU test") == 2
    assert "skinny_linear failed its GPU test (tests/a.py::test_gpu_a)" in capsys.readouterr().out
    assert not any(path.name.startswith("failed") for path in tmp_path.iterdir())  # not a file the call brings back


def test_a_failed_gpu_test_names_its_fast_paths_and_a_passed_one_does_not(tmp_path, monkeypatch):
    """tests/conftest.py's report hook, on stand-in items and reports; and a marker naming no op or
    fast path stops the collection."""
    from types import SimpleNamespace

    from tests import conftest

    def item(*names, test="test_gpu_x"):
        markers = [SimpleNamespace(args=names)] if names else []
        return SimpleNamespace(nodeid=f"tests/kernels/test_x.py::{test}",
                               iter_markers=lambda name: iter(markers if name == "fast_path" else []))

    def report(test_item, failed, error="AssertionError: max error 0.2"):
        hook = conftest.pytest_runtest_makereport(test_item, None)
        next(hook)
        with pytest.raises(StopIteration):
            hook.send(SimpleNamespace(get_result=lambda: SimpleNamespace(failed=failed, longreprtext=error)))

    def recorded():
        return [line.split("\t") for line in target.read_text().splitlines()]

    target = tmp_path / "failed.txt"
    report(item("skinny_linear"), failed=True)  # the variable unset: nothing written
    assert not target.exists()
    monkeypatch.setenv(conftest.FAILED_FAST_PATHS_ENV_VAR, str(target))
    report(item("skinny_linear"), failed=False)
    report(item(), failed=True)
    assert not target.exists()
    report(item("add_rms_norm_router", "norm_router_routes"), failed=True)
    report(item("skinny_linear"), failed=True)
    test = "tests/kernels/test_x.py::test_gpu_x"
    assert recorded() == [["add_rms_norm_router", test], ["norm_router_routes", test], ["skinny_linear", test]]
    # a test that loses the worker's CUDA context is named; the failures after it in that worker
    # are its echo, and name nothing
    monkeypatch.setattr(conftest, "_cuda_context_lost_in", [])
    target.unlink()
    lost = "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"
    report(item("fp8_widen_ptx", test="test_gpu_culprit"), failed=True, error=lost)
    report(item("fused_moe", test="test_gpu_echo"), failed=True, error=lost)
    report(item("skinny_linear", test="test_gpu_later"), failed=True)
    assert recorded() == [["fp8_widen_ptx", "tests/kernels/test_x.py::test_gpu_culprit"]]
    assert conftest._cuda_context_lost_in == ["tests/kernels/test_x.py::test_gpu_culprit"]
    conftest.pytest_collection_modifyitems(None, [item("skinny_linear"), item()])
    with pytest.raises(pytest.UsageError, match="fast_path\\(skinny_lineer\\) names no op"):
        conftest.pytest_collection_modifyitems(None, [item("skinny_lineer")])


def test_steps_picks_a_plans_steps_in_its_order_and_names_unknown_ones(session, capsys):
    assert session.main(["--plan", "record", "--steps", "vision_encoder,constrained", "--dry-run"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed] == ["constrained", "vision_encoder"]
    with pytest.raises(SystemExit):
        session.main(["--plan", "record", "--steps", "constrained,tune_moe_w8a8", "--dry-run"])
    err = capsys.readouterr().err
    assert "tune_moe_w8a8" in err and "the record plan's steps are pytest_gpu, engines" in err


def test_bad_arguments_are_refused_with_the_reason(session, tmp_path, capsys):
    with pytest.raises(SystemExit):
        session.main(["--budget", "0"])
    assert "--budget must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        session.main(["--wheels", str(tmp_path / "missing"), "--out", str(tmp_path)])
    assert "is not a folder" in capsys.readouterr().err


def test_a_wheels_folder_that_cannot_be_installed_stops_before_any_step(session, tmp_path, capsys):
    empty = tmp_path / "wheels"
    empty.mkdir()
    assert session.main(["--plan", "smoke", "--wheels", str(empty), "--out", str(tmp_path / "out")]) == 1
    assert "holds no wheels" in capsys.readouterr().err
    (empty / "broken-1.0-py3-none-any.whl").write_text("not a zip")
    assert session.main(["--plan", "smoke", "--wheels", str(empty), "--out", str(tmp_path / "out")]) == 1
    assert "pip could not install" in capsys.readouterr().err
    assert not (tmp_path / "out" / "session.json").exists()  # no step ran
