"""A CUDA device the process cannot use is one clear error at start-up (before: torch's
AssertionError "Torch not compiled with CUDA enabled", a traceback from the middle of loading)."""

from __future__ import annotations

import pytest
import torch

from vlm_catalog.engine.config import EngineConfigError
from vlm_catalog.engine.llm_engine import LLMEngine, check_device_present


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch is a CUDA build")
def test_a_cpu_only_torch_names_itself(engine_checkpoint):
    with pytest.raises(EngineConfigError, match=r"device cuda: this torch .* is a CPU-only build; install a CUDA build"):
        LLMEngine(model=engine_checkpoint, device="cuda")


def test_no_gpu_visible_and_an_index_past_the_last_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EngineConfigError, match="no CUDA GPU is visible"):
        check_device_present(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device_present(torch.device("cuda:1"))
    with pytest.raises(EngineConfigError, match=r"device cuda:2: this machine shows 2 GPU\(s\), cuda:0 to cuda:1"):
        check_device_present(torch.device("cuda:2"))
    check_device_present(torch.device("cpu"))
