"""Training state on disk, and the servable model directory next to it.

    <run dir>/
      state.pt    float32 weights, optimizer, step, RNG states, config, loss history
      model/      the model as users get it: config, tokenizer, bfloat16 weights
      log.jsonl   one line per logged step or evaluation

`state.pt` is written to a temporary file and renamed, so a run killed while
saving still has its previous checkpoint. It is never shipped: only `model/`
(about 7 MB for the default shapes) is.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlm_catalog.atomic_files import new_file_mode, replace_atomically
from vlm_catalog.error_text import one_line

STATE_FILE = "state.pt"
MODEL_DIR = "model"
WEIGHTS_FILE = "model.safetensors"


def checkpoint_problem(model_dir: Path, option: str) -> str | None:
    """Why the checkpoint folder given as `option` would not load (None: it would), in one line, from its
    config.json and weight headers alone (`check_checkpoint`): a tool refuses it before its work, not with
    transformers' traceback once it loads the weights."""
    from vlm_catalog.model.config import ModelConfigError
    from vlm_catalog.model.loader import CheckpointError, check_checkpoint

    if not (model_dir / "config.json").is_file():
        return f"{option} {model_dir} is not a checkpoint folder (it has no config.json)"
    try:
        check_checkpoint(model_dir)
    except (ModelConfigError, CheckpointError) as exc:  # another model's config.json, damaged weights
        return f"{option} {model_dir} does not load: {one_line(exc)}"
    return None


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_state(run_dir: Path, state: dict[str, Any]) -> Path:
    """Write `state` to run_dir/state.pt atomically."""
    run_dir.mkdir(parents=True, exist_ok=True)
    # a full disk, or an interrupt: the previous state.pt stays, with no stray temporary
    replace_atomically(run_dir / STATE_FILE, 0o600, lambda handle: torch.save(state, handle))
    return run_dir / STATE_FILE


def load_state(run_dir: Path) -> dict[str, Any]:
    path = run_dir / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no training state to resume from: {path} does not exist")
    return torch.load(path, map_location="cpu", weights_only=False)


def export_model(model: torch.nn.Module, base_checkpoint: Path, out_dir: Path) -> Path:
    """Write a servable checkpoint: `base_checkpoint`'s files with `model`'s weights in bfloat16."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in base_checkpoint.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "model.safetensors.index.json":
            if path.resolve() != (out_dir / path.name).resolve():
                shutil.copy(path, out_dir / path.name)
    state = {name: tensor.detach().to("cpu", torch.bfloat16) for name, tensor in model.state_dict().items()}
    with tempfile.TemporaryDirectory() as scratch:
        model.save_pretrained(scratch, state_dict=state)
        with open(Path(scratch) / WEIGHTS_FILE, "rb") as saved:
            # with the mode a new file gets: safetensors writes 0600, which another account (a
            # service user) could not read
            replace_atomically(out_dir / WEIGHTS_FILE, new_file_mode(), lambda handle: shutil.copyfileobj(saved, handle))
    return out_dir
