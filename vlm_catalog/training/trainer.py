"""The training loop: deterministic for a seed, resumable, logging loss and held-out accuracy.

Loss: teacher forcing on the answer tokens only, with transformers'
`Qwen3VLMoeForConditionalGeneration`. The language-model head runs on the
answer positions alone (a few dozen per example instead of ~1,000 prompt
positions), which gives the same gradients as the full-sequence loss at a
fraction of the cost. Tokens are weighted (`TrainingMix.brand_weight`, ...),
the loss is the weighted mean.

Determinism: the data of step s depends only on s (see `data.py`) and the run
seeds torch, Python and NumPy once; a checkpoint holds the float32 weights,
the optimizer, the step and every RNG state, so `resume` continues exactly
as if the run had not stopped (bitwise on CPU with the same thread count).
SIGINT and SIGTERM finish the current step, save and return.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlm_catalog.atomic_files import write_atomically
from vlm_catalog.signals import StopRequest
from vlm_catalog.training.checkpoint import (
    MODEL_DIR,
    export_model,
    load_state,
    rng_state,
    save_state,
    set_rng_state,
)
from vlm_catalog.training.data import Batch, ExampleBuilder, TrainingMix

LOG_FILE = "log.jsonl"


class TrainingDiverged(RuntimeError):
    """The loss is not a finite number: the run stops before that step's update, without saving."""


@dataclass
class TrainConfig:
    base: Path  # starting checkpoint (tokenizer, config, initial weights)
    run_dir: Path  # where state.pt, model/ and log.jsonl go
    steps: int = 1000  # total optimizer steps of the run (the schedule spans them)
    batch_size: int = 8
    lr: float = 3e-3
    min_lr: float = 1e-4
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    save_every: int = 100
    log_every: int = 10
    eval_every: int = 0  # 0: no periodic held-out evaluation
    eval_seed: int = 9001  # generator seed of the held-out catalogue (never trained on)
    eval_records: int = 64
    mix: TrainingMix = field(default_factory=TrainingMix)

    def __post_init__(self) -> None:
        """Refuse settings that would fail only after a step has run (a modulo by zero, say)."""
        for name, least in (("steps", 1), ("batch_size", 1), ("save_every", 1), ("log_every", 1),
                            ("eval_every", 0), ("eval_records", 1), ("warmup", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer of at least {least}, got {value!r}")
        if not (0 < self.lr < math.inf and 0 <= self.min_lr < math.inf):  # NaN fails too
            raise ValueError(f"lr must be a finite number above 0 and min_lr a finite one of at least 0, "
                             f"got {self.lr} and {self.min_lr}")
        if self.mix.seed == self.eval_seed:  # the held-out catalogue would be the training records
            raise ValueError(f"the data seed and the eval seed must differ (both {self.eval_seed}): the held-out "
                             "records would be the first training records")
        try:
            torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}") from None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["base"], data["run_dir"] = str(self.base), str(self.run_dir)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        values = {name: value for name, value in data.items() if name in known}
        values["base"], values["run_dir"] = Path(values["base"]), Path(values["run_dir"])
        values["mix"] = TrainingMix(**values.get("mix", {}))
        return cls(**values)


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr` at the last step."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = min(1.0, (step - config.warmup) / max(1, config.steps - config.warmup))
    return config.min_lr + (config.lr - config.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def hidden_states(model: torch.nn.Module, batch: Batch, share_prefix: bool = True) -> tuple[torch.Tensor, int]:
    """(last hidden states, index of their first position in the rows).

    With `share_prefix` and a batch whose rows start with the same system
    prompt, that prefix runs once, without gradient, and its keys and values
    serve every row: the forward pass is unchanged, the gradient leaves out
    only the prefix's own activations (the same text in every example).
    """
    if share_prefix and batch.prefix_length:
        return _hidden_after_shared_prefix(model, batch), batch.prefix_length  # (B, L - P, hidden)
    return model.model(**batch.inputs).last_hidden_state, 0  # (B, L, hidden)


def _cross_entropy(model: torch.nn.Module, hidden: torch.Tensor, rows: torch.Tensor,
                   positions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token loss of `targets` predicted at (rows, positions); the LM head runs there only."""
    logits = model.lm_head(hidden[rows, positions]).float()  # (T, vocab)
    return torch.nn.functional.cross_entropy(logits, targets, reduction="none")  # (T,)


def answer_loss(model: torch.nn.Module, batch: Batch, share_prefix: bool = True) -> torch.Tensor:
    """Weighted mean cross-entropy of the answer tokens."""
    hidden, first = hidden_states(model, batch, share_prefix)
    losses = _cross_entropy(model, hidden, batch.rows, batch.positions - first, batch.targets)
    return (losses * batch.weights).sum() / batch.weights.sum()


def training_loss(model: torch.nn.Module, batch: Batch, prompt_lm_weight: float) -> torch.Tensor:
    """The answer loss plus `prompt_lm_weight` times the mean next-token loss on the listing's text."""
    hidden, first = hidden_states(model, batch)
    losses = _cross_entropy(model, hidden, batch.rows, batch.positions - first, batch.targets)
    loss = (losses * batch.weights).sum() / batch.weights.sum()
    if prompt_lm_weight and batch.text_targets is not None and len(batch.text_targets):
        text = _cross_entropy(model, hidden, batch.text_rows, batch.text_positions - first, batch.text_targets)
        loss = loss + prompt_lm_weight * text.mean()
    return loss


def _hidden_after_shared_prefix(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Last hidden states of the tokens after the shared prefix, (B, L - P, hidden)."""
    from transformers import DynamicCache

    inputs, length = batch.inputs, batch.prefix_length
    input_ids = inputs["input_ids"]  # (B, L)
    rows = input_ids.shape[0]
    position_ids, _ = model.model.get_rope_index(  # (3, B, L): multimodal RoPE of the full rows
        input_ids, mm_token_type_ids=inputs["mm_token_type_ids"],
        image_grid_thw=inputs["image_grid_thw"], attention_mask=inputs["attention_mask"],
    )
    cache = DynamicCache(config=model.config.text_config)
    with torch.no_grad():
        model.model.language_model(
            inputs_embeds=model.model.get_input_embeddings()(input_ids[:1, :length]),  # (1, P, hidden)
            attention_mask=inputs["attention_mask"][:1, :length],
            position_ids=position_ids[:, :1, :length], past_key_values=cache, use_cache=True,
        )
    cache.batch_repeat_interleave(rows)  # (1, heads, P, dim) -> (B, heads, P, dim) per layer
    return model.model(
        input_ids=input_ids[:, length:], attention_mask=inputs["attention_mask"],
        position_ids=position_ids[:, :, length:], past_key_values=cache, use_cache=True,
        pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
        mm_token_type_ids=inputs["mm_token_type_ids"][:, length:],
    ).last_hidden_state


class Trainer:
    """One training run in `config.run_dir`; `Trainer.resume(run_dir)` continues a saved one."""

    def __init__(self, config: TrainConfig, state: dict[str, Any] | None = None) -> None:
        from transformers import Qwen3VLMoeForConditionalGeneration

        from vlm_catalog.engine.llm_engine import check_device_present
        from vlm_catalog.model.loader import check_checkpoint

        self.config = config
        self.device = torch.device(config.device)
        check_device_present(self.device)  # a CPU-only torch, or no such GPU: one clear error, before any work
        # another model's config.json, or damaged weights: ModelConfigError / CheckpointError naming the
        # file, not transformers' SafetensorError from inside its loader
        check_checkpoint(config.base)
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        np.random.seed(config.seed)
        self.builder = ExampleBuilder(config.base, config.mix)
        self.model = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(config.base), dtype=torch.float32)
        self.model.to(self.device).train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay
        )
        self.step = 0
        self.history: list[dict[str, Any]] = []
        if state is not None:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.step = state["step"]
            self.history = state["history"]
            set_rng_state(state["rng"])
            _forget_log_after(config.run_dir / LOG_FILE, self.step)

    @classmethod
    def resume(cls, run_dir: Path, state: dict[str, Any] | None = None, **overrides: Any) -> Trainer:
        """The run saved in `run_dir`, ready to continue; `overrides` change config fields (e.g. steps).
        `state`: its `load_state(run_dir)`, when the caller has read it already."""
        state = state if state is not None else load_state(run_dir)
        data = {**state["config"], **overrides, "run_dir": str(run_dir)}
        return cls(TrainConfig.from_dict(data), state)

    # -- one step ----------------------------------------------------------------------------

    def batch_for(self, step: int) -> Batch:
        first = step * self.config.batch_size
        return self.builder.batch(list(range(first, first + self.config.batch_size)))

    def train_step(self) -> float:
        lr = learning_rate(self.step, self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = self.batch_for(self.step).to(self.device)
        loss = training_loss(self.model, batch, self.config.mix.prompt_lm_weight)
        loss.backward()
        value = loss.item()  # after the backward is queued: on CUDA, before it the host waited for the forward
        if not math.isfinite(value):  # the weights stay those of the last finite step
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingDiverged(
                f"the loss of step {self.step + 1} is {value} (lr {lr:g}): the run stops without saving it; "
                "the last checkpoint is kept. Lower --lr, or resume from the checkpoint to look"
            )
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return value

    # -- the run -----------------------------------------------------------------------------

    def train(self, until_step: int | None = None, deadline: float | None = None) -> list[float]:
        """Train to `until_step` (default: config.steps) or wall-clock `deadline`, then save.

        Returns the losses of the steps run. Saves every `save_every` steps,
        on SIGINT/SIGTERM (after the current step) and at the end.
        """
        config = self.config
        target = min(until_step if until_step is not None else config.steps, config.steps)
        losses: list[float] = []
        started = time.time()
        with StopRequest() as stop:
            while self.step < target:
                loss = self.train_step()
                losses.append(loss)
                self.history.append({"step": self.step, "loss": loss})
                if self.step % config.log_every == 0 or self.step == target:
                    # from the history, which a resumed run keeps: the same line as an uninterrupted run
                    recent = [entry["loss"] for entry in self.history[-config.log_every:]]
                    self._log({"step": self.step, "loss": sum(recent) / len(recent),
                               "lr": learning_rate(self.step - 1, config),
                               "seconds": round(time.time() - started, 1)})
                if config.eval_every and self.step % config.eval_every == 0:
                    self.save()
                    self.evaluate()
                elif self.step % config.save_every == 0:
                    self.save()
                if stop.requested or (deadline is not None and time.time() >= deadline):
                    self._log({"step": self.step, "stopped": stop.requested or "deadline"})
                    break
            self.save()  # still under StopRequest: a signal now is noted, not a kill mid-save
        return losses

    def save(self) -> Path:
        """Checkpoint the run (state.pt) and export the servable bf16 model (model/)."""
        save_state(self.config.run_dir, {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "step": self.step, "rng": rng_state(), "history": self.history,
            "config": self.config.to_dict(),
        })
        return export_model(self.model, self.config.base, self.config.run_dir / MODEL_DIR)

    def evaluate(self, records: int | None = None) -> dict[str, float]:
        """Held-out accuracy of the exported model through our engine (call after `save`)."""
        from vlm_catalog.training.heldout import evaluate_model, heldout_catalogue

        config = self.config
        catalogue = heldout_catalogue(config.run_dir / "heldout", config.eval_seed, records or config.eval_records)
        report = evaluate_model(config.run_dir / MODEL_DIR, catalogue, device=config.device)
        result = {"step": self.step, "heldout_seed": config.eval_seed, "records": report.num_samples,
                  "category_hf1": round(report.category_hf1, 4), "brand_accuracy": round(report.brand_accuracy, 4),
                  "is_secondhand_f1": round(report.is_secondhand_f1, 4), "unparsable": report.num_unparsable}
        self._log(result)
        return result

    def _log(self, entry: dict[str, Any]) -> None:
        print(json.dumps(entry), flush=True)
        self.config.run_dir.mkdir(parents=True, exist_ok=True)
        with (self.config.run_dir / LOG_FILE).open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry) + "\n")


def _forget_log_after(log: Path, step: int) -> None:
    """Drop the log lines of steps after `step`, the checkpoint a resume starts from: a run killed after
    its last save logged steps it now runs again (before, those steps were logged twice). A copy
    without them replaces the log whole (`write_atomically`), so a kill meanwhile leaves the one or the other."""
    if not log.is_file():
        return
    lines = log.read_text(encoding="utf-8").splitlines(keepends=True)

    def kept(line: str) -> bool:
        try:
            return json.loads(line).get("step", 0) <= step
        except (ValueError, AttributeError):  # a line torn by the kill
            return False

    remaining = [line for line in lines if kept(line)]
    if len(remaining) < len(lines):
        write_atomically(log, "".join(remaining))
