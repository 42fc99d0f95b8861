"""Engine settings in one dataclass (checked on construction)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.environment import check_environment
from kernels.fp8 import FP8_DTYPE
from vlm_catalog.model.fp8 import QUANTIZATION_MODES
from vlm_catalog.paths import DEFAULT_MODEL_DIR

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# what the paged KV cache stores: "auto" is the model's dtype; "fp8" (e4m3, as vLLM's
# "fp8"/"fp8_e4m3") halves the bytes per token against bf16, so twice the tokens fit
KV_CACHE_DTYPES = {"fp8": FP8_DTYPE, "fp8_e4m3": FP8_DTYPE}
# how the weights are held, QUANTIZATION_MODES (vlm_catalog/model/fp8.py, loader.py's doc): "auto" keeps an
# FP8 checkpoint's experts in FP8 on CUDA; "fp8" holds them in FP8 anywhere, quantizing an
# unquantized checkpoint at load; "fp8_w8a8" also holds the dense projections in FP8 and
# quantizes every FP8 GEMM's input (FP8 tensor cores); "fp8_w8a8_channel" is "fp8_w8a8" with
# one scale per weight row and per token; "none" widens everything to `dtype`


# the default image prefetch budget on CUDA: a 16k-token step of benchmark-sized images
# holds ~40 MB of pixels (uint8, a byte per value: the GPU normalises them), so this covers many steps ahead
CUDA_IMAGE_PREFETCH_BYTES = 512 * 2**20
MAX_AUTO_GRAMMAR_WORKERS = 8  # grammar_compile_workers=None: half the CPUs, at most this many


class EngineConfigError(ValueError):
    """An engine setting that cannot work; the message names it."""


def check_device_name(name: str, option: str = "device") -> None:
    """`EngineConfigError` (naming `option`) unless `name` is a device the engine takes: cpu, cuda or
    cuda:N ("cuda:x" too is refused here, not by torch in the first request)."""
    if name not in ("cpu", "cuda") and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise EngineConfigError(f"{option} must be 'cpu' or 'cuda[:N]', got {name!r}")


@dataclass
class EngineConfig:
    model: str | Path = DEFAULT_MODEL_DIR
    device: str = "cpu"
    dtype: str = "auto"  # float32 on CPU, bfloat16 on CUDA
    block_size: int = 16
    # KV pool size in bytes. None: on CPU a fixed default; on CUDA what is left of
    # `gpu_memory_utilization` x total device memory after the weights, the activations
    # of a profiled worst-case step and non-torch memory (engine/memory_profile.py)
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "fp8" (e4m3, no scales; kernels/kv_cache.py)
    quantization: str = "auto"  # FP8 weights: one of QUANTIZATION_MODES (above)
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    # tokens per step (prefill chunks + decodes); on the offline benchmark (2 CPU cores)
    # 16384 is about 3% faster than 8192: fewer, fuller prefill steps
    max_num_batched_tokens: int = 16384
    max_model_len: int = 32768
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # or "shortest_prompt_first"
    # append the tokens a grammar forces without model steps. None (auto): on, unless decode steps
    # replay CUDA graphs. A request with forced tokens makes the next step a multi-token (prefill)
    # step, which runs eagerly: on the H100 the constrained run took 62 ms per step against 33 ms
    # unconstrained (docs/benchmarks.md). Greedy and seeded answers are the same either way.
    enable_jump_forward: bool | None = None
    encoder_cache_tokens: int = 32768  # image embeddings kept, in language-model tokens
    max_images_per_prompt: int = 8
    grammar_compile_timeout_s: float = 30.0
    grammar_cache_size: int = 512
    # threads compiling per-request grammars (a constrained request is scheduled once its grammar
    # is compiled; one record's catalogue schema took 46 ms over a 152k-token stand-in
    # vocabulary on one thread, docs/benchmarks.md). None: half the CPUs, 1 to 8 (`grammar_workers`)
    grammar_compile_workers: int | None = None
    image_workers: int | None = None  # threads decoding images; None: one per CPU
    # host memory for the pixels of images decoded ahead, while the device runs a step
    # (engine/image_prefetch.py); 0: decode each image when a step first needs it. None:
    # CUDA_IMAGE_PREFETCH_BYTES on CUDA, 0 on CPU (where the forward pass needs the same
    # cores: scripts/bench_image_prefetch.py measured no gain there)
    image_prefetch_bytes: int | None = None
    enforce_eager: bool = False  # no CUDA graphs for decode steps (they are only used on CUDA)
    # schedule and launch step N+1 before reading step N's sampled tokens, which the host then
    # processes while the device runs N+1 (engine/pending_tokens.py); the same answers for greedy
    # and seeded requests, outputs one step later. Off: each step reads its tokens first. None
    # (auto): on CUDA (an H100 on 2026-11-28: 18.04 samples/s against 17.58, docs/benchmarks.md),
    # off on CPU, where the forward pass is synchronous and leaves nothing to overlap
    async_scheduling: bool | None = None
    cuda_graph_max_batch: int = 256  # largest decode batch captured (capped at max_num_seqs)
    # run dummy requests at start-up so Triton compiles each step size's kernels before serving
    # (engine/warmup.py). None (auto): on CUDA, off on CPU (whose torch path compiles nothing)
    warmup: bool | None = None
    tune_cpu_allocator: bool = True  # on CPU, keep freed memory for reuse (see engine/cpu_allocator.py)
    # hand the host heap's free pages back to the kernel this often (glibc; 0: never), so a
    # fragmenting heap over a long job does not hold ever more idle memory
    release_host_memory_every_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        self.model = Path(self.model)
        check_device_name(self.device)
        if self.dtype == "auto":
            self.dtype = "float32" if self.device == "cpu" else "bfloat16"
        if self.dtype not in DTYPES:
            raise EngineConfigError(f"dtype must be auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineConfigError(
                f"kv_cache_dtype must be auto or {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}"
            )
        if self.quantization not in QUANTIZATION_MODES:
            raise EngineConfigError(
                f"quantization must be one of {', '.join(QUANTIZATION_MODES)}; got {self.quantization!r}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "encoder_cache_tokens", "max_images_per_prompt", "grammar_cache_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):  # "4" would fail later, deep in a step
                raise EngineConfigError(f"{name} must be an integer, got {value!r}")
            if value < 1:
                raise EngineConfigError(f"{name} must be at least 1, got {value}")
        if self.grammar_compile_workers is not None and int(self.grammar_compile_workers) < 1:
            raise EngineConfigError(
                f"grammar_compile_workers must be at least 1 (None: half the CPUs), got {self.grammar_compile_workers}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise EngineConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not self.release_host_memory_every_s >= 0:  # NaN fails too
            raise EngineConfigError(
                f"release_host_memory_every_s must be >= 0 (0: never), got {self.release_host_memory_every_s}"
            )
        if self.image_prefetch_bytes is None:
            self.image_prefetch_bytes = 0 if self.device == "cpu" else CUDA_IMAGE_PREFETCH_BYTES
        if self.image_prefetch_bytes < 0:
            raise EngineConfigError(f"image_prefetch_bytes must be >= 0 (0: off), got {self.image_prefetch_bytes}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise EngineConfigError("kv_cache_memory_bytes must be positive")
        try:  # the kernel switches (environment), read on every op: a typo fails here, not in a request
            check_environment(self.torch_device.type)
        except ValueError as exc:
            raise EngineConfigError(str(exc)) from None

    def grammar_workers(self) -> int:
        """Threads compiling grammars: the setting, or half the CPUs (at least 1, at most 8)."""
        if self.grammar_compile_workers is not None:
            return int(self.grammar_compile_workers)
        return max(1, min(MAX_AUTO_GRAMMAR_WORKERS, (os.cpu_count() or 2) // 2))

    def jump_forward(self, decode_graphs: bool) -> bool:
        """Whether the engine jumps forward: the setting, or on auto (None) off where decode steps
        replay CUDA graphs (`decode_graphs`) and on where every step runs eagerly."""
        if self.enable_jump_forward is None:
            return not decode_graphs
        return self.enable_jump_forward

    def schedules_async(self) -> bool:
        """Whether the engine schedules each step before reading the last one's tokens: the
        setting, or on auto (None) on CUDA only."""
        return self._on_cuda_unless_set(self.async_scheduling)

    def warms_up(self) -> bool:
        """Whether the engine runs the start-up warm-up: the setting, or on auto (None) on CUDA only."""
        return self._on_cuda_unless_set(self.warmup)

    def _on_cuda_unless_set(self, setting: bool | None) -> bool:
        return self.torch_device.type == "cuda" if setting is None else setting

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_kv_cache_dtype(self) -> torch.dtype:
        return self.torch_dtype if self.kv_cache_dtype == "auto" else KV_CACHE_DTYPES[self.kv_cache_dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)
