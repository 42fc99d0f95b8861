"""A checkpoint's default sampling settings, from its `generation_config.json`.

The benchmark's reference harness sends no sampling settings and leaves them to
the server, which takes them from this file (Qwen3-VL: `do_sample: true`,
temperature 0.7, top-p 0.8, top-k 20, repetition penalty 1.0). The service uses
them as the defaults of a request that names none; the LoadGen harness's
"mlperf" request style sends them explicitly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlm_catalog.engine.sampling_params import GREEDY_BELOW_TEMPERATURE, SamplingParams

# settings the engine does not implement, with the value that means "off"
UNSUPPORTED_SETTINGS = (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0))


class GenerationConfigError(ValueError):
    """A generation_config.json that cannot be read, or asks for what the engine cannot do."""


@dataclass(frozen=True)
class Sampling:
    """Decoding settings: temperature 0 is greedy; top_p 1 and top_k 0 are off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE  # as SamplingParams.greedy

    def params(self, **settings: Any) -> SamplingParams:
        """`SamplingParams` drawing with these settings, plus `settings` (max_tokens, ...)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, **settings)


GREEDY = Sampling()
# the Qwen3-VL checkpoints' generation_config.json: what the benchmark's requests sample with
QWEN3_VL_SAMPLING = Sampling(temperature=0.7, top_p=0.8, top_k=20)


def generation_config_sampling(model_dir: str | Path) -> Sampling:
    """The sampling settings of a checkpoint's `generation_config.json`.

    `do_sample: false` (or no file) means greedy. A missing field takes the
    engine's default (temperature 1, top-p 1, top-k off). A setting the engine
    does not implement (a repetition, presence or frequency penalty) raises
    `GenerationConfigError` rather than being ignored.
    """
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return GREEDY
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GenerationConfigError(f"{path}: cannot read ({exc})") from None
    if not isinstance(config, dict):
        raise GenerationConfigError(f"{path}: expected a JSON object")
    for name, neutral in UNSUPPORTED_SETTINGS:
        value = config.get(name, neutral)
        if value != neutral:
            raise GenerationConfigError(f"{path}: {name} = {value} is not supported by the engine (only {neutral})")
    if config.get("do_sample") is False:
        return GREEDY
    try:
        return Sampling(
            temperature=float(config.get("temperature", 1.0)),
            top_p=float(config.get("top_p", 1.0)),
            top_k=max(int(config.get("top_k", 0)), 0),
        )
    except (TypeError, ValueError) as exc:
        raise GenerationConfigError(f"{path}: bad sampling setting ({exc})") from None
