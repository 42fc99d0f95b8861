"""The training loop: exact loss, determinism, checkpoint/resume, signals, held-out evaluation."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from tests.training.conftest import tiny_config
from vlm_catalog.training.trainer import Trainer, answer_loss, learning_rate, training_loss


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in trainer.model.state_dict().items()}


def test_answer_loss_equals_transformers_loss_on_the_answer(tiny_base: Path, tmp_path: Path) -> None:
    """The LM head on answer positions only, and the shared system prompt run once, change no loss."""
    trainer = Trainer(tiny_config(tiny_base, tmp_path / "run", batch_size=3))
    batch = trainer.batch_for(0)
    assert batch.prefix_length > 100  # the system prompt is shared
    batch.weights = torch.ones_like(batch.weights)
    labels = torch.full_like(batch.inputs["input_ids"], -100)  # (B, L)
    labels[batch.rows, batch.positions + 1] = batch.targets
    with torch.no_grad():
        reference = trainer.model(**batch.inputs, labels=labels).loss
        full = answer_loss(trainer.model, batch, share_prefix=False)
        shared = answer_loss(trainer.model, batch, share_prefix=True)
    assert torch.allclose(full, reference, atol=1e-5), (full, reference)
    assert torch.allclose(shared, reference, atol=1e-5), (shared, reference)

    text_labels = torch.full_like(labels, -100)  # (B, L): the listing's next-token targets
    text_labels[batch.text_rows, batch.text_positions + 1] = batch.text_targets
    with torch.no_grad():
        text_reference = trainer.model(**batch.inputs, labels=text_labels).loss
        combined = training_loss(trainer.model, batch, prompt_lm_weight=0.25)
    assert torch.allclose(combined, reference + 0.25 * text_reference, atol=1e-5)


def test_learning_rate_schedule(tiny_base: Path, tmp_path: Path) -> None:
    config = tiny_config(tiny_base, tmp_path, steps=100, lr=1e-2, min_lr=1e-4, warmup=10)
    assert learning_rate(0, config) == pytest.approx(1e-3)
    assert learning_rate(9, config) == pytest.approx(1e-2)
    assert learning_rate(55, config) == pytest.approx((1e-2 + 1e-4) / 2)
    assert learning_rate(100, config) == pytest.approx(1e-4)
    assert all(learning_rate(s, config) >= learning_rate(s + 1, config) for s in range(10, 100))


def test_deterministic_and_resume_continues_exactly(tiny_base: Path, tmp_path: Path) -> None:
    """Two runs of one seed, one of them stopped after 2 steps and resumed: the same 4 losses, bitwise."""
    straight = Trainer(tiny_config(tiny_base, tmp_path / "straight", log_every=2))
    straight_losses = straight.train(until_step=4)

    interrupted = Trainer(tiny_config(tiny_base, tmp_path / "resumed", log_every=2))
    losses = interrupted.train(until_step=3)
    del interrupted
    resumed = Trainer.resume(tmp_path / "resumed")
    assert resumed.step == 3
    losses += resumed.train(until_step=4)

    assert losses == straight_losses
    assert straight_losses[0] != straight_losses[3]  # it trains
    for name, tensor in _weights(straight).items():
        assert torch.equal(tensor, _weights(resumed)[name]), name

    def logged(run: str) -> dict[int, float]:
        lines = [json.loads(line) for line in (tmp_path / run / "log.jsonl").read_text().splitlines()]
        return {entry["step"]: entry["loss"] for entry in lines if "loss" in entry}

    # every log_every steps, and where a run stops; the mean over the same steps after a resume
    assert logged("straight").keys() == {2, 4} and logged("resumed").keys() == {2, 3, 4}
    assert logged("resumed")[4] == logged("straight")[4] == sum(straight_losses[2:4]) / 2


def test_a_run_killed_after_its_last_save_logs_each_step_once_on_resume(tiny_base: Path, tmp_path: Path) -> None:
    """kill -9 at step 3 of a run saved at step 2: the resume runs step 3 again, and logged it twice."""
    run = tmp_path / "run"
    trainer = Trainer(tiny_config(tiny_base, run, log_every=1, save_every=2))
    trainer.train(until_step=2)
    step_once = trainer.train_step

    def step_then_log_and_die() -> float:  # what a kill -9 after step 3's log line leaves: the line, no save
        loss = step_once()
        trainer._log({"step": trainer.step, "loss": loss})
        with (run / "log.jsonl").open("a") as log:
            log.write('{"step": 4, "lo')  # and half of the next line
        raise SystemExit("killed")

    trainer.train_step = step_then_log_and_die
    with pytest.raises(SystemExit):
        trainer.train(until_step=4)
    resumed = Trainer.resume(run)
    assert resumed.step == 2
    resumed.train(until_step=4)
    steps = [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_a_loss_that_is_not_finite_stops_the_run_without_saving_it(tiny_base: Path, tmp_path: Path,
                                                                   monkeypatch) -> None:
    from vlm_catalog.training import trainer as trainer_module
    from vlm_catalog.training.trainer import TrainingDiverged

    run = tmp_path / "run"
    trainer = Trainer(tiny_config(tiny_base, run, save_every=1))
    trainer.train(until_step=1)
    saved = _weights(Trainer.resume(run))
    real_loss = trainer_module.training_loss
    monkeypatch.setattr(trainer_module, "training_loss", lambda *args: real_loss(*args) * float("nan"))
    with pytest.raises(TrainingDiverged, match="the loss of step 2 is nan"):
        trainer.train(until_step=3)
    again = Trainer.resume(run)
    assert again.step == 1 and all(torch.equal(tensor, saved[name]) for name, tensor in _weights(again).items())
    assert "NaN" not in (run / "log.jsonl").read_text()  # the log stays standard JSON


def test_the_exported_model_is_readable_by_other_accounts(tiny_base: Path, tmp_path: Path) -> None:
    """safetensors writes 0600 and the export copied that: a service account could not load the model."""
    previous = os.umask(0o022)
    try:
        Trainer(tiny_config(tiny_base, tmp_path / "run")).train(until_step=1)
    finally:
        os.umask(previous)
    assert (tmp_path / "run" / "model" / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_sigterm_saves_and_stops(tiny_base: Path, tmp_path: Path) -> None:
    trainer = Trainer(tiny_config(tiny_base, tmp_path / "run"))
    step_once = trainer.train_step

    def step_then_terminate() -> float:
        loss = step_once()
        if trainer.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    trainer.train_step = step_then_terminate
    previous = signal.getsignal(signal.SIGTERM)
    losses = trainer.train(until_step=6)
    assert len(losses) == 2
    assert signal.getsignal(signal.SIGTERM) is previous  # the handler is put back
    assert Trainer.resume(tmp_path / "run").step == 2
    log = (tmp_path / "run" / "log.jsonl").read_text()
    assert '"stopped": "SIGTERM"' in log


def test_a_signal_during_the_final_save_is_noted_not_fatal(tiny_base: Path, tmp_path: Path) -> None:
    trainer = Trainer(tiny_config(tiny_base, tmp_path / "run"))
    handlers = []
    save_once = trainer.save

    def save_noting_the_handler() -> Path:
        handlers.append(signal.getsignal(signal.SIGTERM))
        return save_once()

    trainer.save = save_noting_the_handler
    previous = signal.getsignal(signal.SIGTERM)
    trainer.train(until_step=1)
    # before: the final save ran after the handler was put back, so a SIGTERM then killed the run unsaved
    assert handlers and all(handler is not previous for handler in handlers)
    assert signal.getsignal(signal.SIGTERM) is previous


def test_a_failed_save_keeps_the_previous_state_and_leaves_no_temporary(tmp_path: Path, monkeypatch) -> None:
    from vlm_catalog.training import checkpoint

    checkpoint.save_state(tmp_path, {"step": 1})

    def disk_full(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        checkpoint.save_state(tmp_path, {"step": 2})
    assert sorted(path.name for path in tmp_path.iterdir()) == ["state.pt"]
    assert checkpoint.load_state(tmp_path)["step"] == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [({"steps": 0}, "steps must be an integer of at least 1"), ({"log_every": 0}, "log_every"),
     ({"save_every": 0}, "save_every"), ({"batch_size": 0}, "batch_size"), ({"eval_every": -1}, "eval_every"),
     ({"lr": 0.0}, "lr must be a finite number above 0"), ({"lr": float("nan")}, "lr must be a finite number"),
     # before, accepted: inf trained to NaN and exited 0; equal seeds scored the held-out on training records;
     # a device torch cannot name was a RuntimeError traceback
     ({"lr": float("inf")}, "lr must be a finite number"), ({"min_lr": float("inf")}, "min_lr a finite one"),
     ({"eval_seed": 77}, "the data seed and the eval seed must differ"), ({"device": "bogus"}, "device must be")],
)
def test_settings_that_would_fail_mid_run_are_refused_up_front(tmp_path: Path, change, message) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_config(tmp_path, tmp_path / "run", **change)


def test_export_and_heldout_evaluation_through_the_engine(tiny_base: Path, tmp_path: Path) -> None:
    trainer = Trainer(tiny_config(tiny_base, tmp_path / "run", eval_records=4, eval_seed=123))
    trainer.train(until_step=1)
    exported = tmp_path / "run" / "model"
    assert (exported / "model.safetensors").is_file() and (exported / "tokenizer.json").is_file()
    from safetensors import safe_open

    with safe_open(str(exported / "model.safetensors"), "pt") as handle:
        name = next(iter(handle.keys()))
        assert handle.get_tensor(name).dtype == torch.bfloat16
    result = trainer.evaluate()
    assert result["records"] == 4 and result["heldout_seed"] == 123
    assert 0.0 <= result["category_hf1"] <= 1.0 and 0 <= result["unparsable"] <= 4
    logged = json.loads((tmp_path / "run" / "log.jsonl").read_text().splitlines()[-1])
    assert logged == result


def test_script_refuses_to_overwrite_a_run_and_resumes(tiny_base: Path, tmp_path: Path, capsys) -> None:
    script = _train_script()
    run = tmp_path / "run"
    common = ["--run-dir", str(run), "--batch-size", "1", "--log-every", "1"]
    assert script.main([*common, "--base", str(tiny_base), "--steps", "3", "--until-step", "1"]) == 0
    assert script.main([*common, "--base", str(tiny_base), "--steps", "3"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert script.main([*common, "--resume", "--until-step", "2"]) == 0
    assert Trainer.resume(run).step == 2
    assert script.main([*common, "--resume", "--base", str(tiny_base)]) == 0  # the same base, given again
    assert Trainer.resume(run).step == 3
    capsys.readouterr()


def test_a_run_begun_with_a_relative_base_resumes_from_another_folder(tiny_base: Path, tmp_path: Path,
                                                                      monkeypatch, capsys) -> None:
    """--base was saved as typed: from another folder the resume failed (a traceback), and the absolute
    path was refused as a changed setting. It is saved resolved; a run saved the old way takes --base."""
    script = _train_script()
    run = tmp_path / "run"
    monkeypatch.chdir(tiny_base.parent)
    common = ["--run-dir", str(run), "--batch-size", "1", "--steps", "3"]
    assert script.main([*common, "--base", tiny_base.name, "--until-step", "1"]) == 0
    monkeypatch.chdir(tmp_path)
    assert script.main(["--run-dir", str(run), "--resume", "--until-step", "2"]) == 0
    assert Trainer.resume(run).step == 2

    state = torch.load(run / "state.pt", weights_only=False)  # as an earlier version saved it
    state["config"]["base"] = tiny_base.name
    torch.save(state, run / "state.pt")
    capsys.readouterr()
    assert script.main(["--run-dir", str(run), "--resume"]) == 2
    assert "is not found from here; pass --base with its path" in capsys.readouterr().err
    assert script.main(["--run-dir", str(run), "--resume", "--base", str(tiny_base), "--steps", "4",
                        "--until-step", "3"]) == 0
    assert Trainer.resume(run).step == 3

    moved = tmp_path / "moved-base"  # the base moved since the run began: the saved absolute path is gone
    state = torch.load(run / "state.pt", weights_only=False)
    state["config"]["base"] = str(tmp_path / "gone")
    torch.save(state, run / "state.pt")
    import shutil

    shutil.copytree(tiny_base, moved)
    capsys.readouterr()
    assert script.main(["--run-dir", str(run), "--resume"]) == 2
    assert "is not found from here; pass --base with its path" in capsys.readouterr().err
    assert script.main(["--run-dir", str(run), "--resume", "--base", str(moved)]) == 0
    assert Trainer.resume(run).step == 4


def _train_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_script", Path("scripts/train_default_model.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_script_refuses_a_base_device_or_mix_it_cannot_use_and_leaves_no_run_folder(
        tiny_base: Path, bases_that_do_not_load: dict[str, Path], tmp_path: Path, capsys) -> None:
    """A base of another model type or with damaged weights was a ModelConfigError / SafetensorError
    traceback; a mix out of range trained and saved; a device the machine lacks, like those, left an
    empty run folder. An empty run folder that was there before stays."""
    script = _train_script()
    base = ["--base", str(tiny_base)]
    cases = [(["--base", str(path)], f"--base {path} does not load: ") for path in bases_that_do_not_load.values()]
    cases += [([*base, "--device", "cuda:99"], "device cuda:99: "),  # a CPU-only torch, or too few GPUs
              ([*base, "--fresh-brand-rate", "5"], "fresh_brand_rate must be a share from 0 to 1"),
              ([*base, "--brand-weight", "-1"], "brand_weight must be a finite number of at least 0"),
              ([*base, "--flag-weight", "nan"], "flag_weight must be a finite number of at least 0")]
    existing = tmp_path / "existing"
    existing.mkdir()
    for argv, message in cases:
        for run in (tmp_path / "new" / "run", existing):
            assert script.main(["--run-dir", str(run), "--steps", "1", "--batch-size", "1", *argv]) == 2, argv
            err = capsys.readouterr().err
            assert err.startswith("error: ") and err.count("\n") == 1 and message in err, (argv, err)
        assert not (tmp_path / "new").exists() and existing.is_dir() and not any(existing.iterdir()), argv


def test_script_refuses_what_it_cannot_do_before_training(tiny_base: Path, tmp_path: Path, capsys) -> None:
    """Each case is one `error:` line and exit 2, before a step runs (some used to fail after training)."""
    script = _train_script()
    run = tmp_path / "run"
    base = ["--base", str(tiny_base)]
    assert script.main(["--run-dir", str(run), *base, "--batch-size", "1", "--lr", "0.01", "--steps", "4",
                        "--until-step", "2"]) == 0
    capsys.readouterr()
    a_file = tmp_path / "afile"
    a_file.write_text("precious")
    leftovers = tmp_path / "leftovers"
    leftovers.mkdir()
    (leftovers / "log.jsonl").write_text('{"step": 1, "loss": 2.0}\n')  # a run killed before its first save
    cases = [
        (["--run-dir", str(a_file), *base], "is a file"),
        # before, these trained first and then failed (a traceback, the work lost)
        (["--run-dir", str(a_file / "run"), *base], "cannot be written: Not a directory"),
        (["--run-dir", str(tmp_path / "new"), *base, "--data-seed", "9001"], "the data seed and the eval seed"),
        (["--run-dir", str(tmp_path / "new"), *base, "--device", "bogus"], "device must be cpu or cuda"),
        (["--run-dir", str(leftovers), *base], "not empty and holds no state.pt"),
        (["--run-dir", str(tmp_path / "new"), "--base", str(tmp_path / "nowhere")], "not a checkpoint folder"),
        (["--run-dir", str(tmp_path / "new"), *base, "--log-every", "0"], "log_every must be"),
        (["--run-dir", str(tmp_path / "none"), "--resume"], "there is no run to continue"),
        (["--run-dir", str(run), "--resume", "--lr", "100", "--batch-size", "4"],
         r"only --steps, .* These differ: --batch-size 4 \(saved: 1\); --lr 100.0 \(saved: 0.01\)"),
        (["--run-dir", str(run), "--resume", "--steps", "1"], r"--steps 1 is below the step the run is at \(2\)"),
    ]
    for argv, message in cases:
        assert script.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and re.search(message, err), (argv, err)
    assert a_file.read_text() == "precious" and Trainer.resume(run).step == 2
    assert not (tmp_path / "new").exists()  # a start refused for its settings leaves no run folder behind
    assert script.main(["--run-dir", str(run), "--resume", "--lr", "0.01", "--batch-size", "1"]) == 0  # as saved
    for argv in (["--max-minutes", "0"], ["--steps", "0"], ["--until-step", "0"]):
        with pytest.raises(SystemExit) as stopped:  # argparse's usage error
            script.main(["--run-dir", str(tmp_path / "new"), *argv])
        assert stopped.value.code == 2
