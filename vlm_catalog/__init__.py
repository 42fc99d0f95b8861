"""vlm-catalog: structured product metadata from images and text with Qwen3-VL-MoE models.

`LLM`, `SamplingParams` and `AsyncLLM` are imported lazily, so `import
vlm_catalog` stays cheap (no torch, no model code) for the command line.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "vlm_catalog.llm",
    "Extraction": "vlm_catalog.llm",
    "SamplingParams": "vlm_catalog.engine.sampling_params",
    "RequestOutput": "vlm_catalog.engine.outputs",
    "AsyncLLM": "vlm_catalog.engine.async_engine",
    "EngineConfig": "vlm_catalog.engine.config",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vlm_catalog' has no attribute {name!r}")
