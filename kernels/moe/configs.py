"""Block sizes for the fused-MoE grouped GEMMs, per model shape and batch size.

Like vLLM's per-GPU JSON tables: keyed by (num_experts, hidden, intermediate,
dtype name, token-count bucket). A batch of T tokens uses the entry of the
smallest bucket >= T (the largest bucket above that); shapes without an entry
use `heuristic_moe_config`.

STATUS: NOT YET TUNED. Every entry below is a reasoned default (tuned=False),
written without a GPU. Reasoning, for H100/H200 and bf16:

* rows per expert ~ T * top_k / E (8/128 of the tokens for Qwen3-VL-MoE). Up to
  ~16 rows (T <= 256) every expert's weights are streamed once for a handful of
  rows: the GEMMs are weight-bandwidth bound, so BLOCK_M = 16 (the tl.dot
  minimum), wide BLOCK_K for long contiguous weight loads, deep pipelines.
* with more rows per expert, larger BLOCK_M reuses each weight tile across more
  rows; BLOCK_N * BLOCK_K stays within shared memory at 3-4 stages
  (the gate/up kernel holds two weight tiles and two accumulators).
* GROUP_SIZE_M > 1 only helps when an expert has several M blocks.

Measure with ``python scripts/bench_kernels.py --tune-moe`` on the target GPU:
it prints one ready-to-paste line per bucket (tuned=True).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class MoeKernelConfig:
    block_size_m: int  # rows (token, k pairs) per program; also the alignment block
    block_size_n: int  # output columns per program
    block_size_k: int  # reduction step
    group_size_m: int  # M blocks walked together for L2 reuse of weight tiles
    num_warps: int
    num_stages: int
    tuned: bool = False  # True only for values measured by `bench_kernels.py --tune-moe`

    def launch_options(self) -> dict[str, int]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def as_moe_config(config: MoeKernelConfig | Mapping[str, int]) -> MoeKernelConfig:
    """Accepts a MoeKernelConfig or a mapping of its field names."""
    if isinstance(config, MoeKernelConfig):
        return config
    return MoeKernelConfig(**dict(config))


def token_bucket(num_tokens: int) -> int:
    for bucket in TOKEN_BUCKETS:
        if num_tokens <= bucket:
            return bucket
    return TOKEN_BUCKETS[-1]


def heuristic_moe_config(num_tokens: int, num_experts: int, top_k: int = 8) -> MoeKernelConfig:
    """Defaults from the expected rows per expert (see the module docstring)."""
    rows_per_expert = num_tokens * top_k / max(num_experts, 1)
    if rows_per_expert <= 16:
        return MoeKernelConfig(16, 64, 128, 1, num_warps=4, num_stages=4)
    if rows_per_expert <= 64:
        return MoeKernelConfig(32, 64, 128, 4, num_warps=4, num_stages=4)
    if rows_per_expert <= 256:
        return MoeKernelConfig(64, 64, 64, 8, num_warps=4, num_stages=3)
    return MoeKernelConfig(128, 64, 64, 8, num_warps=8, num_stages=3)


def _reasoned_table(
    num_experts: int, hidden: int, intermediate: int, dtype: str, top_k: int
) -> dict[tuple[int, int, int, str, int], MoeKernelConfig]:
    return {
        (num_experts, hidden, intermediate, dtype, bucket): heuristic_moe_config(
            bucket, num_experts, top_k
        )
        for bucket in TOKEN_BUCKETS
    }


# (E, H, I, expert weight dtype, bucket) -> config. NOT YET TUNED: reasoned defaults only.
MOE_CONFIGS: dict[tuple[int, int, int, str, int], MoeKernelConfig] = {
    # Qwen3-VL-30B-A3B: 128 experts, top-8, hidden 2048, expert intermediate 768
    **_reasoned_table(128, 2048, 768, "bfloat16", top_k=8),
    # Qwen3-VL-235B-A22B: 128 experts, top-8, hidden 4096, expert intermediate 1536
    **_reasoned_table(128, 4096, 1536, "bfloat16", top_k=8),
    # the same with FP8 experts (Qwen's -FP8 checkpoints, --quantization fp8)
    **_reasoned_table(128, 2048, 768, "float8_e4m3fn", top_k=8),
    **_reasoned_table(128, 4096, 1536, "float8_e4m3fn", top_k=8),
    # Paste measured entries from `scripts/bench_kernels.py --tune-moe` below this line.
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def get_moe_config(
    num_tokens: int,
    num_experts: int,
    hidden: int,
    intermediate: int,
    dtype: torch.dtype,
    top_k: int = 8,
) -> MoeKernelConfig:
    """The table entry for this shape and batch size, else the heuristic."""
    key = (num_experts, hidden, intermediate, dtype_name(dtype), token_bucket(num_tokens))
    config = MOE_CONFIGS.get(key)
    if config is not None:
        return config
    return heuristic_moe_config(num_tokens, num_experts, top_k)


def format_config_entry(
    num_experts: int,
    hidden: int,
    intermediate: int,
    dtype: torch.dtype,
    bucket: int,
    config: MoeKernelConfig,
) -> str:
    """One line to paste into MOE_CONFIGS."""
    fields = ", ".join(f"{name}={value!r}" for name, value in asdict(config).items())
    return (
        f"    ({num_experts}, {hidden}, {intermediate}, {dtype_name(dtype)!r}, {bucket}): "
        f"MoeKernelConfig({fields}),"
    )
