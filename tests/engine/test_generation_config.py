"""A checkpoint's default sampling settings (generation_config.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlm_catalog.engine.generation_config import (
    GREEDY,
    GenerationConfigError,
    Sampling,
    generation_config_sampling,
)
from vlm_catalog.paths import DEFAULT_MODEL_DIR


def write_generation_config(directory: Path, values) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(values))
    return directory


def test_qwen3_vl_settings_are_read(tmp_path):
    qwen = write_generation_config(
        tmp_path, {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.0}
    )
    assert generation_config_sampling(qwen) == Sampling(temperature=0.7, top_p=0.8, top_k=20)


def test_greedy_without_sampling(tmp_path):
    assert generation_config_sampling(DEFAULT_MODEL_DIR) == GREEDY  # the shipped model: do_sample false
    assert generation_config_sampling(tmp_path / "none") == GREEDY  # no file
    assert GREEDY.greedy and not Sampling(temperature=0.7).greedy


def test_missing_fields_take_the_engine_defaults(tmp_path):
    assert generation_config_sampling(write_generation_config(tmp_path, {"do_sample": True})) == Sampling(1.0, 1.0, 0)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"do_sample": True, "repetition_penalty": 1.05}, "repetition_penalty = 1.05 is not supported"),
        ({"do_sample": True, "presence_penalty": 0.5}, "presence_penalty = 0.5 is not supported"),
        ({"do_sample": True, "temperature": "hot"}, "bad sampling setting"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_what_the_engine_cannot_do_is_refused(tmp_path, values, message):
    with pytest.raises(GenerationConfigError, match=message):
        generation_config_sampling(write_generation_config(tmp_path, values))


def test_unreadable_file_is_refused(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(GenerationConfigError, match="cannot read"):
        generation_config_sampling(tmp_path)
