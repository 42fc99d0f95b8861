"""Size the KV-cache pool from a profiling pass over the worst-case step.

Before the KV pool exists, the engine runs one step at the largest shapes the
scheduler can produce and measures the activation memory it needed, then gives
the KV pool what is left of `gpu_memory_utilization` of the device (vLLM sizes
its pool the same way with its "profile run"):

    kv_bytes = total * gpu_memory_utilization
               - weights            torch memory held before the step (the model)
               - peak_activations   peak torch allocation of the step, above that
               - non_torch          used outside torch: CUDA context, cuBLAS/Triton
                                    workspaces, other processes (total - free - reserved)
               - reserve            CUDA-graph pool (fixed), and two caches when full:
                                    the encoder cache's image embeddings
                                    (`encoder_cache_bytes`) and the vision tower's
                                    grid tables (`grid_tables_max_bytes`)

The worst-case step (`worst_case_step`) is `max_num_batched_tokens` language-model
tokens in one prefill sequence, the most image placeholders among them, the
last `min(max_num_seqs, tokens)` rows sampled (logits in float32, drawn
through the sampler's most memory-hungry path: top-p over a full sort of the
vocabulary), and a vision-tower call over images at the
largest size the processor allows, enough of them to cover the step's image
tokens plus one more image: a prefill chunk can end inside an image, and the
whole image is encoded then.

The device is reached only through `DeviceMemory`, so tests can simulate a
device budget on CPU (`CudaMemory` is the real one).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from vlm_catalog.engine.config import EngineConfigError
from vlm_catalog.engine.paged_attention import (
    PagedAttention,
    PagedAttentionMetadata,
    PrefillBatch,
    allocate_kv_caches,
)
from vlm_catalog.engine.sampler import sample_most_memory
from vlm_catalog.model.qwen3_vl_moe import Qwen3VLMoeModel
from vlm_catalog.model.text import MultimodalEmbeddings
from vlm_catalog.preprocess.image import ImageProcessor, normalise_patch_bytes

logger = logging.getLogger(__name__)

GiB = 2**30
# CUDA graphs for decode steps are captured after the KV pool is allocated, into
# one shared pool; decode activations are small, so a fixed margin covers them.
CUDA_GRAPH_RESERVE_BYTES = GiB // 2


class DeviceMemory(Protocol):
    """The device-memory queries the profiling pass needs (bytes)."""

    def total(self) -> int: ...
    def free(self) -> int: ...
    def allocated(self) -> int: ...  # held by live torch tensors
    def reserved(self) -> int: ...  # held by torch's caching allocator (>= allocated)
    def reset_peak(self) -> None: ...
    def peak_allocated(self) -> int: ...  # since the last reset_peak
    def release_cached(self) -> None: ...  # synchronize and return cached blocks to the device


class CudaMemory:
    """`DeviceMemory` of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def total(self) -> int:
        return torch.cuda.mem_get_info(self.device)[1]

    def free(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def release_cached(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- the step
@dataclass(frozen=True)
class WorstCaseStep:
    num_tokens: int  # language-model tokens, one prefill sequence
    num_image_tokens: int  # of those, image placeholders
    num_sampled: int  # rows that produce logits
    image_grid: tuple[int, int, int]  # (t, h, w) patches of the largest image
    num_images: int  # images encoded in the step

    @property
    def num_patches(self) -> int:
        return self.num_images * math.prod(self.image_grid)


def worst_case_step(
    max_num_batched_tokens: int, max_num_seqs: int, image_processor: ImageProcessor, max_images: int | None = None
) -> WorstCaseStep:
    """The largest step the scheduler can hand the runner (module doc).

    `max_images` caps the images encoded (e.g. max_images_per_prompt x max_num_seqs);
    None: no cap beyond what the step's tokens need.
    """
    side = math.isqrt(image_processor.max_pixels)
    grid = image_processor.grid_thw_for_size(side, side)
    tokens_per_image = math.prod(grid) // image_processor.merge_size**2
    num_images = -(-max_num_batched_tokens // tokens_per_image) + 1  # cover the step, plus one straddling
    if max_images is not None:
        num_images = max(1, min(num_images, max_images))
    return WorstCaseStep(
        num_tokens=max_num_batched_tokens,
        num_image_tokens=min(max_num_batched_tokens, num_images * tokens_per_image),
        num_sampled=min(max_num_seqs, max_num_batched_tokens),
        image_grid=grid,
        num_images=num_images,
    )


class _ProfileInputs:
    """Inputs and a temporary KV cache for one worst-case step (allocated before the peak is reset)."""

    def __init__(
        self, model: Qwen3VLMoeModel, step: WorstCaseStep, block_size: int, seed: int, kv_cache_dtype: torch.dtype
    ) -> None:
        config = model.config
        device = model.device
        generator = torch.Generator().manual_seed(seed)
        vision = config.vision
        # [num_images * patches_per_image, C * T * P * P] uint8, as the runner copies decoded images over;
        # run() normalises them on the device as the runner does, so that pass counts in the peak
        self.pixel_bytes = torch.randint(0, 256, (step.num_patches, vision.patch_dim), generator=generator,
                                         dtype=torch.uint8).to(device)
        self.pixel_scale = torch.full((vision.in_channels, 1), 2 / 255, device=device)  # [C, 1] float32
        self.pixel_offset = torch.full((vision.in_channels, 1), -1.0, device=device)
        self.pixel_dtype = model.visual.patch_embed.pixel_dtype
        self.grids = torch.tensor([step.image_grid] * step.num_images, device=device)  # [num_images, 3]
        ids = torch.randint(0, config.text.vocab_size, (step.num_tokens,), generator=generator)
        ids[: step.num_image_tokens] = config.image_token_id
        self.input_ids = ids.to(device)  # [T]
        self.positions = torch.arange(step.num_tokens).unsqueeze(0).expand(3, -1).to(device)  # [3, T] int64
        num_blocks = -(-step.num_tokens // block_size)
        text = config.text
        self.kv_caches = allocate_kv_caches(
            text.num_layers, num_blocks, block_size, text.num_kv_heads, text.head_dim, kv_cache_dtype, device
        )
        self.metadata = PagedAttentionMetadata(
            decode=None,
            prefill=PrefillBatch(
                slot_mapping=torch.arange(step.num_tokens, device=device),
                block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device).unsqueeze(0),  # [1, blocks]
                cu_seqlens_q=torch.tensor([0, step.num_tokens], dtype=torch.int32, device=device),
                context_lens=torch.tensor([step.num_tokens], dtype=torch.int32, device=device),
                max_query_len=step.num_tokens,
                host_lens=([step.num_tokens], [step.num_tokens]),  # a whole prompt: the engine's backend choice
            ),
        )

    @torch.inference_mode()
    def run(self, model: Qwen3VLMoeModel, step: WorstCaseStep) -> None:
        # the float32 pass is freed at once, as in ModelRunner.normalised
        pixel_values = normalise_patch_bytes(self.pixel_bytes, self.pixel_scale, self.pixel_offset).to(self.pixel_dtype)
        images = model.encode_images(pixel_values, self.grids)
        embeddings = torch.cat([image.embeddings for image in images])[: step.num_image_tokens]
        deepstack = [
            torch.cat([image.deepstack[j] for image in images])[: step.num_image_tokens]
            for j in range(len(images[0].deepstack))
        ]
        rows = torch.arange(step.num_image_tokens, device=self.input_ids.device)  # the image tokens come first
        multimodal = MultimodalEmbeddings(rows=rows, embeddings=embeddings, deepstack=deepstack)
        hidden = model(self.input_ids, self.positions, PagedAttention(self.kv_caches, self.metadata), multimodal)
        logits = model.compute_logits(hidden[-step.num_sampled :]).float()  # [S, V], as the runner returns them
        sample_most_memory(logits)  # the sampler's temporaries at their largest: a full sort and its filters


# --------------------------------------------------------------------------- the budget
@dataclass(frozen=True)
class MemoryBudget:
    total_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    peak_activation_bytes: int
    non_torch_bytes: int
    reserve_bytes: int

    @property
    def kv_cache_bytes(self) -> int:
        """What the formula in the module doc leaves for the KV pool (may be <= 0)."""
        usable = int(self.total_bytes * self.gpu_memory_utilization)
        return usable - self.weights_bytes - self.peak_activation_bytes - self.non_torch_bytes - self.reserve_bytes

    def check(self, min_kv_bytes: int) -> None:
        """Raise EngineConfigError, with the breakdown, if the KV pool would get under `min_kv_bytes`."""
        if self.kv_cache_bytes < min_kv_bytes:
            raise EngineConfigError(
                f"no room for the KV cache: gpu_memory_utilization={self.gpu_memory_utilization} of "
                f"{self.total_bytes / GiB:.2f} GiB leaves {self.kv_cache_bytes / GiB:.2f} GiB after weights "
                f"{self.weights_bytes / GiB:.2f} GiB, peak activations {self.peak_activation_bytes / GiB:.2f} GiB "
                f"(max_num_batched_tokens and the largest images), non-torch {self.non_torch_bytes / GiB:.2f} GiB "
                f"and reserve {self.reserve_bytes / GiB:.2f} GiB (CUDA graphs, the encoder cache, the grid tables); "
                f"at least {min_kv_bytes} bytes are needed. "
                "Raise gpu_memory_utilization, lower max_num_batched_tokens or the image processor's max_pixels, "
                "or set kv_cache_memory_bytes."
            )

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "kv_cache_bytes": self.kv_cache_bytes}


def profile_memory(
    model: Qwen3VLMoeModel,
    step: WorstCaseStep,
    memory: DeviceMemory,
    gpu_memory_utilization: float,
    block_size: int,
    reserve_bytes: int = CUDA_GRAPH_RESERVE_BYTES,
    kv_cache_dtype: torch.dtype | None = None,
) -> MemoryBudget:
    """Run the worst-case step on `model` and measure what the KV pool may take
    (`kv_cache_dtype`: what the pool will hold; default the model's dtype)."""
    memory.release_cached()
    weights = memory.allocated()
    inputs = _ProfileInputs(model, step, block_size, seed=0, kv_cache_dtype=kv_cache_dtype or model.dtype)
    memory.release_cached()
    baseline = memory.allocated()  # weights + the step's inputs and temporary cache
    memory.reset_peak()
    inputs.run(model, step)
    memory.release_cached()
    peak_activations = max(0, memory.peak_allocated() - baseline)
    del inputs
    memory.release_cached()
    non_torch = max(0, memory.total() - memory.free() - memory.reserved())
    budget = MemoryBudget(
        total_bytes=memory.total(),
        gpu_memory_utilization=gpu_memory_utilization,
        weights_bytes=weights,
        peak_activation_bytes=peak_activations,
        non_torch_bytes=non_torch,
        reserve_bytes=reserve_bytes,
    )
    logger.info(
        "memory profile (%d tokens, %d image tokens, %d images of grid %s): %s",
        step.num_tokens, step.num_image_tokens, step.num_images, step.image_grid,
        {k: f"{v / GiB:.2f} GiB" if k.endswith("bytes") else v for k, v in budget.as_dict().items()},
    )
    return budget
