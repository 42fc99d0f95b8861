"""The engine's eager forward passes never make the host wait for the device.

On the H100 of 2026-11-28 the host spent about as long inside each prefill step's text
forward as the device did (6.38 s against 6.31 s over a run): either its launches were that
slow, or something in the forward waited for the device (`.item()`, `.tolist()` of a device
tensor, a boolean mask, a blocking copy). A wait there also keeps the host from preparing the
next step while the device computes, which async scheduling exists for. This test runs
prefill steps with images, chunked prompts over cached contexts and decodes in the same step
under CUDA's sync debug mode set to "error", so any such wait fails with the op that made it.
It needs a GPU; on CPU there is no device to wait for."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import mixed_conversations
from vlm_catalog import LLM, SamplingParams

GPU_SHARE = 0.3  # of the device for the profiled engine: `pytest -m gpu` runs on several workers


def waits_are_errors(function):
    """`function` with CUDA's sync debug mode "error" while it runs: a host-device
    synchronization inside it raises, naming the op."""

    def audited(*args, **kwargs):
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return function(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    return audited


@pytest.mark.gpu
@pytest.mark.xdist_group("gpu_memory")  # sizes its KV pool from the free device memory
@pytest.mark.parametrize("quantization", ["auto", "fp8_w8a8_channel"])
def test_gpu_prefill_steps_with_images_never_wait_for_the_device(engine_checkpoint, quantization):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    # small steps: prompts are chunked (chunks over cached contexts), and decodes share steps
    # with prefill chunks; the warm-up (on by default on CUDA) has run every first-call check
    llm = LLM(engine_checkpoint, device="cuda", kv_cache_dtype="fp8", quantization=quantization,
              gpu_memory_utilization=GPU_SHARE, block_size=4, max_num_batched_tokens=64)
    model = llm.engine.runner.model
    model.forward = waits_are_errors(model.forward)  # the text forward of every eager step
    model.encode_images = waits_are_errors(model.encode_images)  # the vision tower
    answers = llm.chat(mixed_conversations(8), SamplingParams(max_tokens=6, ignore_eos=True))
    assert [len(answer.token_ids) for answer in answers] == [6] * 8
    assert llm.engine.stats.num_prefill_steps > 8  # chunked: several prefill steps, some with decodes
    llm.engine.close()
