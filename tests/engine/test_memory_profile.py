"""KV-pool sizing from a profiling pass, on a simulated device budget (CPU)."""

import pytest
import torch

from tests.engine.conftest import conversation
from vlm_catalog.engine.config import EngineConfigError
from vlm_catalog.engine.encoder_cache import encoder_cache_bytes
from vlm_catalog.engine.llm_engine import LLMEngine
from vlm_catalog.engine.memory_profile import (
    CUDA_GRAPH_RESERVE_BYTES,
    MemoryBudget,
    profile_memory,
    worst_case_step,
)
from vlm_catalog.engine.paged_attention import kv_bytes_per_block
from vlm_catalog.engine.sampling_params import SamplingParams
from vlm_catalog.model.config import ModelConfig
from vlm_catalog.model.loader import load_model
from vlm_catalog.preprocess.image import ImageProcessor

MiB = 2**20


class SimulatedMemory:
    """A device with `total` bytes, `weights` held by torch, `non_torch` used by others, and a
    worst-case step that needs `activations` bytes above what was allocated when the peak was reset.
    Records the order of calls so a test can see the step ran between reset and read-out."""

    def __init__(self, total: int, weights: int, non_torch: int, activations: int, log: list[str]) -> None:
        self.total_bytes, self.weights, self.non_torch, self.activations, self.log = total, weights, non_torch, activations, log

    def total(self) -> int:
        return self.total_bytes

    def free(self) -> int:
        return self.total_bytes - self.weights - self.non_torch

    def allocated(self) -> int:
        return self.weights

    def reserved(self) -> int:
        return self.weights

    def reset_peak(self) -> None:
        self.log.append("reset_peak")

    def peak_allocated(self) -> int:
        self.log.append("peak_allocated")
        return self.weights + self.activations

    def release_cached(self) -> None:
        pass


def test_worst_case_step_covers_the_batch_and_one_straddling_image_at_max_pixels():
    processor = ImageProcessor()  # Qwen3-VL: 16 px patches, merge 2, max_pixels 4096 x 4096
    step = worst_case_step(16384, 256, processor)
    assert step.image_grid == (1, 256, 256)  # 4096 px / 16 per side: 16384 tokens per image
    assert step.num_images == 2  # one fills the step, one more can straddle its end
    assert step.num_patches == 2 * 256 * 256
    assert (step.num_tokens, step.num_image_tokens, step.num_sampled) == (16384, 16384, 256)
    small = worst_case_step(1000, 4, ImageProcessor(max_pixels=256 * 256))  # 64 tokens per image
    assert (small.num_images, small.num_image_tokens, small.num_sampled) == (17, 1000, 4)
    assert worst_case_step(1000, 4, ImageProcessor(max_pixels=256 * 256), max_images=3).num_image_tokens == 192


def test_profile_runs_the_step_between_peak_reset_and_read_out_and_applies_the_formula(engine_checkpoint, monkeypatch):
    model = load_model(engine_checkpoint)
    log: list[str] = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *args: (log.append("forward"), forward(*args))[1])
    memory = SimulatedMemory(total=1000 * MiB, weights=300 * MiB, non_torch=50 * MiB, activations=120 * MiB, log=log)
    step = worst_case_step(300, 8, ImageProcessor(min_pixels=32 * 32, max_pixels=128 * 128))
    budget = profile_memory(model, step, memory, gpu_memory_utilization=0.8, block_size=16, reserve_bytes=10 * MiB)
    assert log == ["reset_peak", "forward", "peak_allocated"]
    assert (budget.weights_bytes, budget.peak_activation_bytes, budget.non_torch_bytes) == (300 * MiB, 120 * MiB, 50 * MiB)
    assert budget.kv_cache_bytes == int(1000 * MiB * 0.8) - 300 * MiB - 120 * MiB - 50 * MiB - 10 * MiB


def _engine_with_simulated_device(monkeypatch, checkpoint, memory, **config):
    monkeypatch.setattr(LLMEngine, "_device_memory", lambda self: memory)
    return LLMEngine(model=checkpoint, **config)


def test_engine_pool_is_what_the_profile_leaves_and_defaults_stay_in_budget(engine_checkpoint, monkeypatch):
    model_config = ModelConfig.from_pretrained(engine_checkpoint)
    text = model_config.text
    per_block = kv_bytes_per_block(text.num_layers, 16, text.num_kv_heads, text.head_dim, torch.float32)
    # the decode graphs' pool (enforce_eager is off by default), and two caches when full: the
    # encoder cache's 32768 tokens of an embedding and the deepstack rows, float32 in this model,
    # and the vision tower's 262144 patches of tables (a position row, rotary cos and sin)
    vision = model_config.vision
    cached_images = encoder_cache_bytes(32768, model_config, torch.float32)
    assert cached_images == 32768 * (1 + len(vision.deepstack_visual_indexes)) * text.hidden_size * 4
    grid_tables = 262_144 * (vision.hidden_size * 4 + 2 * vision.head_dim * 4)
    reserve = CUDA_GRAPH_RESERVE_BYTES + cached_images + grid_tables
    weights, non_torch, activations = 40 * MiB, 30 * MiB, 25 * MiB
    wanted_blocks = 37
    # a device whose 90% leaves 37.5 blocks for the KV pool
    total = int((weights + non_torch + activations + reserve + wanted_blocks * per_block + per_block // 2) / 0.9) + 1
    memory = SimulatedMemory(total, weights, non_torch, activations, log=[])
    engine = _engine_with_simulated_device(monkeypatch, engine_checkpoint, memory, max_num_batched_tokens=512)
    try:
        assert engine.num_blocks == wanted_blocks
        used = weights + non_torch + activations + reserve + engine.num_blocks * per_block
        assert used <= total * engine.config.gpu_memory_utilization
        stats = engine.cache_stats()
        assert stats["kv_capacity_tokens"] == wanted_blocks * 16
        assert stats["memory_profile"]["peak_activation_bytes"] == activations
        assert stats["memory_profile"]["reserve_bytes"] == reserve
        engine.add_request(conversation(0, images=1), SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.close()


def test_an_impossible_budget_is_a_clear_config_error(engine_checkpoint, monkeypatch):
    memory = SimulatedMemory(total=100 * MiB, weights=80 * MiB, non_torch=5 * MiB, activations=10 * MiB, log=[])
    with pytest.raises(EngineConfigError, match=r"no room for the KV cache: gpu_memory_utilization=0.9 .*peak activations"):
        _engine_with_simulated_device(monkeypatch, engine_checkpoint, memory, max_num_batched_tokens=256)


def test_budget_breakdown_is_reported():
    budget = MemoryBudget(80 * 2**30, 0.9, 61 * 2**30, 4 * 2**30, 2**30, 2**29)
    assert budget.kv_cache_bytes == int(80 * 2**30 * 0.9) - 61 * 2**30 - 4 * 2**30 - 2**30 - 2**29
    assert budget.as_dict()["kv_cache_bytes"] == budget.kv_cache_bytes
    with pytest.raises(EngineConfigError, match="lower max_num_batched_tokens"):
        MemoryBudget(80 * 2**30, 0.8, 61 * 2**30, 4 * 2**30, 2**30, 0).check(1)


def test_an_fp8_cache_fits_four_times_the_float32_tokens_in_the_same_budget(engine_checkpoint, monkeypatch):
    text = ModelConfig.from_pretrained(engine_checkpoint).text
    fp32_block = kv_bytes_per_block(text.num_layers, 16, text.num_kv_heads, text.head_dim, torch.float32)
    fp8_block = kv_bytes_per_block(text.num_layers, 16, text.num_kv_heads, text.head_dim, torch.float8_e4m3fn)
    assert fp32_block == 4 * fp8_block
    weights, non_torch, activations = 40 * MiB, 30 * MiB, 25 * MiB
    model_config = ModelConfig.from_pretrained(engine_checkpoint)
    reserve = (CUDA_GRAPH_RESERVE_BYTES + encoder_cache_bytes(32768, model_config, torch.float32)
               + 262_144 * (model_config.vision.hidden_size + 2 * model_config.vision.head_dim) * 4)
    total = int((weights + non_torch + activations + reserve + 10 * fp32_block) / 0.9) + 1
    blocks = {}
    for kv_cache_dtype in ("auto", "fp8"):
        memory = SimulatedMemory(total, weights, non_torch, activations, log=[])
        engine = _engine_with_simulated_device(
            monkeypatch, engine_checkpoint, memory, max_num_batched_tokens=512, kv_cache_dtype=kv_cache_dtype
        )
        try:
            blocks[kv_cache_dtype] = engine.num_blocks
            assert engine.kv_caches[0][0].dtype == (torch.float32 if kv_cache_dtype == "auto" else torch.float8_e4m3fn)
            assert engine.cache_stats()["kv_cache_dtype"] == ("float32" if kv_cache_dtype == "auto" else "float8_e4m3fn")
        finally:
            engine.close()
    assert blocks == {"auto": 10, "fp8": 40}
