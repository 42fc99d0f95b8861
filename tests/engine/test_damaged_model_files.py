"""A checkpoint folder with a damaged file (a download cut short, a bad edit) fails at start-up
with one error naming the file: never a traceback, and never a template that fails every request."""

from __future__ import annotations

import re
import shutil

import pytest

from tests.conftest import write_lfs_pointer
from vlm_catalog.engine.llm_engine import LLMEngine
from vlm_catalog.model.config import ModelConfigError
from vlm_catalog.model.loader import CheckpointError


def cut_short(path):
    path.write_bytes(path.read_bytes()[:30])


DAMAGE = {
    # file: (how it is damaged, the error type, what the message says)
    "config.json": (cut_short, ModelConfigError, "config.json: not valid JSON"),
    "config.json ": (lambda path: path.write_text("[]"), ModelConfigError, "config.json: holds a JSON list, not an object"),
    "model.safetensors": (cut_short, CheckpointError, "model.safetensors: not a readable safetensors file"),
    "tokenizer.json": (cut_short, ModelConfigError, "the tokenizer cannot be loaded"),
    "tokenizer_config.json": (cut_short, ModelConfigError, "the tokenizer cannot be loaded"),
    "preprocessor_config.json": (cut_short, ModelConfigError, "preprocessor_config.json is not valid JSON"),
    "generation_config.json": (cut_short, ModelConfigError, "generation_config.json: not a JSON object"),
    "chat_template.jinja": (lambda path: path.write_text("{% for m in %}"), ModelConfigError,
                            "the chat template cannot make a prompt: the chat template rejected the messages"),
    "model.safetensors  ": (write_lfs_pointer, ModelConfigError, "model.safetensors is a Git LFS pointer, not the file"),
    "tokenizer.json  ": (write_lfs_pointer, ModelConfigError, "tokenizer.json is a Git LFS pointer, not the file"),
    "chat_template.jinja ": (lambda path: path.write_text("{% for m in messages %}{{ m.role }}{% endfor %}"),
                             ModelConfigError, "it renders 0 image placeholders ('<|image_pad|>') for one image"),
}


def case_id(name: str) -> str:
    kind = {0: "", 1: "-not-an-object" if name.startswith("config") else "-no-image", 2: "-lfs-pointer"}
    return name.strip() + kind[len(name) - len(name.rstrip())]


@pytest.mark.parametrize("name", list(DAMAGE), ids=[case_id(name) for name in DAMAGE])
def test_a_damaged_file_is_named_at_start_up(engine_checkpoint, tmp_path, name):
    damage, error, message = DAMAGE[name]
    model = tmp_path / "model"
    shutil.copytree(engine_checkpoint, model)
    damage(model / name.strip())  # a chat_template.jinja written takes precedence over any other template
    with pytest.raises(error, match=re.escape(message)):
        LLMEngine(model=model)


def test_the_undamaged_copy_starts(engine_checkpoint, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(engine_checkpoint, model)
    assert LLMEngine(model=model).processor.image_token == "<|image_pad|>"


@pytest.mark.parametrize(("name", "value", "vision_name"), [
    ("merge_size", 1, "spatial_merge_size"), ("patch_size", 8, "patch_size"), ("temporal_patch_size", 1, "temporal_patch_size"),
])
def test_a_preprocessor_that_cuts_images_otherwise_than_the_tower_is_refused(engine_checkpoint, tmp_path, name, value,
                                                                             vision_name):
    """A merge size the tower does not use was served silently wrong: the prompt held the
    preprocessor's count of image tokens, the tower gave another, and its rows were cut to fit. A
    patch size it does not take failed every image request."""
    import json

    model = tmp_path / "model"
    shutil.copytree(engine_checkpoint, model)
    vision = json.loads((model / "config.json").read_text())["vision_config"]
    preprocessor = json.loads((model / "preprocessor_config.json").read_text())
    preprocessor[name] = value
    (model / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    expected = (f"preprocessor_config.json has {name} {value}, but config.json's vision_config has {vision_name} "
                f"{vision[vision_name]}")
    with pytest.raises(ModelConfigError, match=re.escape(expected)):
        LLMEngine(model=model)
