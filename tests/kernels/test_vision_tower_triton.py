"""The vision tower on the Triton kernels (rotary, varlen attention) gives the reference path's output."""

from __future__ import annotations

import torch

from tests.kernels.helpers import FLOAT32_TOLERANCE, assert_close
from tests.model.test_vision_tables import images, tiny_tower


def test_tower_on_triton_matches_the_reference_path(triton_device, monkeypatch):
    # tolerance: float32 1e-4 of max |expected|, the kernels' own float32 tolerance
    tower = tiny_tower().to(triton_device)
    pixels, grids = images([(1, 4, 6), (2, 4, 4), (1, 8, 4)], tower.config.patch_dim)
    pixels = pixels.to(triton_device)
    with torch.inference_mode():
        on_triton = tower(pixels, grids)
        monkeypatch.setenv("VLM_CATALOG_KERNELS", "reference")
        on_reference = tower(pixels, grids)
    assert_close(on_triton.embeddings, on_reference.embeddings, rel=FLOAT32_TOLERANCE, what="embeddings")
    for index, (actual, expected) in enumerate(zip(on_triton.deepstack, on_reference.deepstack)):
        assert_close(actual, expected, rel=FLOAT32_TOLERANCE, what=f"deepstack {index}")
