"""The training loop: exact loss, determinism, checkpoint/resume, signals, held-out evaluation."""

from __future__ import annotations

import json
import os
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
    straight = Trainer(tiny_config(tiny_base, tmp_path / "straight"))
    straight_losses = straight.train(until_step=4)

    interrupted = Trainer(tiny_config(tiny_base, tmp_path / "resumed"))
    losses = interrupted.train(until_step=2)
    del interrupted
    resumed = Trainer.resume(tmp_path / "resumed")
    assert resumed.step == 2
    losses += resumed.train(until_step=4)

    assert losses == straight_losses
    assert straight_losses[0] != straight_losses[3]  # it trains
    for name, tensor in _weights(straight).items():
        assert torch.equal(tensor, _weights(resumed)[name]), name
    log = [json.loads(line) for line in (tmp_path / "resumed" / "log.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in log if "loss" in entry] == [1, 2, 3, 4]


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
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_script", Path("scripts/train_default_model.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    run = tmp_path / "run"
    common = ["--run-dir", str(run), "--batch-size", "1", "--log-every", "1"]
    assert script.main([*common, "--base", str(tiny_base), "--steps", "3", "--until-step", "1"]) == 0
    assert script.main([*common, "--base", str(tiny_base), "--steps", "3"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert script.main([*common, "--resume"]) == 0
    assert Trainer.resume(run).step == 3
    with pytest.raises(FileNotFoundError, match="no training state"):
        script.main(["--run-dir", str(tmp_path / "none"), "--resume"])
