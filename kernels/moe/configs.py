"""Block sizes for the fused-MoE grouped GEMMs, per model shape and batch size.

Like vLLM's per-GPU JSON tables: keyed by (num_experts, hidden, intermediate,
dtype name, token-count bucket); the dtype name is the experts' weight dtype,
with "_w8a8" appended for FP8 weights met by FP8 activations, then "_channel"
for per-channel FP8 experts whose GEMMs keep the wgmma asynchronous and
want tiles of their own (`table_dtype`; with FP8 activations only under
VLM_CATALOG_FP8_FAST_ACCUMULATION, `fused_moe.asynchronous_k_loops`).
A batch of T tokens uses the entry of the smallest bucket >= T (the largest
bucket above that); shapes without an entry use `heuristic_moe_config`.

STATUS: the bf16 30B-A3B shape has entries measured on an H100 (tuned=True) for
the buckets 1, 64, 256, 4096 and 16384 (2026-11-25), and at 8192 the tile its
tuned neighbours agree on; every other entry is a reasoned default
(tuned=False), written without a GPU. Reasoning, for H100/H200 and bf16:

* rows per expert ~ T * top_k / E (8/128 of the tokens for Qwen3-VL-MoE). Up to
  ~16 rows (T <= 256) every expert's weights are streamed once for a handful of
  rows: the GEMMs are weight-bandwidth bound, so one row block should hold all
  of an expert's rows. Up to 8 rows on average (T <= 128) that is BLOCK_M = 16
  (the tl.dot minimum; an expert gets more than 16 in about 1 case of 250).
  At 16 on average about 4 experts in 10 get 17 or more, and a second row block
  reads their weights again, so BLOCK_M = 32 there: the bf16 tuning on the H100
  (2026-11-25) and vLLM's bf16 H100 table for this expert shape both pick 32
  at 256 tokens (vLLM's picks 16 at every bucket below).
* with more rows per expert, larger BLOCK_M reuses each weight tile across more
  rows; BLOCK_N * BLOCK_K stays within shared memory at 3-4 stages
  (the gate/up kernel holds two weight tiles and two accumulators).
* GROUP_SIZE_M > 1 only helps when an expert has several M blocks.
* FP8 weights: BLOCK_K 128 throughout (`heuristic_moe_config`), one step per
  scale block and the same bytes per stage as a 16-bit tile's 64.

Measure with ``python scripts/bench_kernels.py --tune-moe [--fp8 [--w8a8]]`` on
the target GPU: it prints one ready-to-paste line per bucket (tuned=True), and with
``--write-table PATH`` it writes them into a JSON table of that GPU model
(`kernels/tuned_configs.py`). Such tables take precedence over this one:
``VLM_CATALOG_TUNED_CONFIGS=PATH`` on every device, and the packaged
``kernels/tuned/<GPU model>.json`` on that model (`get_moe_config`'s `device`).

Every config `get_moe_config` returns fits an H100 block's shared memory for
the weights' element size (`fit_shared_memory`): the table is written for
2-byte weights, and the same tiles in float32 (the CPU-sized test models on a
GPU) need twice the bytes per pipeline stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

import torch

from kernels.checks import dtype_name
from kernels.tuned_configs import tuned_configs

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
W8A8_SUFFIX = "_w8a8"  # the dtype field of FP8 experts' entries for FP8 activations (table_dtype)
CHANNEL_SUFFIX = "_channel"  # ... and for per-channel FP8 experts (one scale per row spanning K)


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


# Shared memory one block may use on an H100 (227 KiB, with the opt-in Triton asks for).
MAX_SHARED_MEMORY_BYTES = 232448


def gate_up_shared_memory_bytes(config: MoeKernelConfig, element_bytes: int) -> int:
    """What the gate/up kernel (the larger of the two GEMMs) keeps in shared memory: Triton's
    software pipeline holds num_stages - 1 copies of the A tile [BLOCK_M, BLOCK_K] and the
    gate and up weight tiles [BLOCK_K, BLOCK_N] each. (This matched the 245,760 B an H100
    reported for BLOCK_M 32, BLOCK_N 64, BLOCK_K 128, 4 stages in float32.)"""
    tile_elements = config.block_size_k * (config.block_size_m + 2 * config.block_size_n)
    return (max(config.num_stages, 2) - 1) * tile_elements * element_bytes


def fit_shared_memory(config: MoeKernelConfig, element_bytes: int) -> MoeKernelConfig:
    """`config`, with fewer pipeline stages (down to 2), then a shorter BLOCK_K (down to 16),
    until its gate/up tiles fit `MAX_SHARED_MEMORY_BYTES`; unchanged when it already fits."""
    while gate_up_shared_memory_bytes(config, element_bytes) > MAX_SHARED_MEMORY_BYTES:
        if config.num_stages > 2:
            config = replace(config, num_stages=config.num_stages - 1)
        elif config.block_size_k > 16:
            config = replace(config, block_size_k=config.block_size_k // 2)
        else:
            break
    return config


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


def heuristic_moe_config(num_tokens: int, num_experts: int, top_k: int = 8, weight_bytes: int = 2) -> MoeKernelConfig:
    """Defaults from the expected rows per expert (see the module docstring). One-byte (FP8)
    weights take BLOCK_K 128 at every size: the same bytes per pipeline stage as the 16-bit
    tiles' 64, and one step per 128-wide scale block, as vLLM's block-quantized MoE defaults.
    A step of a block-scaled FP8 GEMM waits for its wgmma before scaling the product, so half
    as many steps halve those waits; in the sm_90 SASS at T=8192 (Triton 3.6) the 128 x 64
    tile then issues 0.74 / 1.04 warp instructions per 1k MACs (W8A8 gate/up / down) against
    1.27 / 1.69 at BLOCK_K 64, with no spill (docs/benchmarks.md)."""
    rows_per_expert = num_tokens * top_k / max(num_experts, 1)
    block_k = 128 if weight_bytes == 1 else 64  # for the two larger tiles; the small ones take 128
    if rows_per_expert <= 8:
        return MoeKernelConfig(16, 64, 128, 1, num_warps=4, num_stages=4)
    if rows_per_expert <= 64:
        return MoeKernelConfig(32, 64, 128, 4, num_warps=4, num_stages=4)
    if rows_per_expert <= 256:
        return MoeKernelConfig(64, 64, block_k, 8, num_warps=4, num_stages=3)
    return MoeKernelConfig(128, 64, block_k, 8, num_warps=8, num_stages=3)


def _reasoned_table(
    num_experts: int, hidden: int, intermediate: int, dtype: str, top_k: int
) -> dict[tuple[int, int, int, str, int], MoeKernelConfig]:
    weight_bytes = 1 if dtype.startswith("float8") else 2
    return {
        (num_experts, hidden, intermediate, dtype, bucket): heuristic_moe_config(
            bucket, num_experts, top_k, weight_bytes
        )
        for bucket in TOKEN_BUCKETS
    }


# (E, H, I, expert weight dtype, bucket) -> config: reasoned defaults, then the measured entries.
MOE_CONFIGS: dict[tuple[int, int, int, str, int], MoeKernelConfig] = {
    # Qwen3-VL-30B-A3B: 128 experts, top-8, hidden 2048, expert intermediate 768
    **_reasoned_table(128, 2048, 768, "bfloat16", top_k=8),
    # Qwen3-VL-235B-A22B: 128 experts, top-8, hidden 4096, expert intermediate 1536
    **_reasoned_table(128, 4096, 1536, "bfloat16", top_k=8),
    # the same with FP8 experts (Qwen's -FP8 checkpoints, --quantization fp8)
    **_reasoned_table(128, 2048, 768, "float8_e4m3fn", top_k=8),
    **_reasoned_table(128, 4096, 1536, "float8_e4m3fn", top_k=8),
    # and with FP8 activations too (--quantization fp8_w8a8): both dot operands FP8, tiles of their own
    **_reasoned_table(128, 2048, 768, "float8_e4m3fn" + W8A8_SUFFIX, top_k=8),
    **_reasoned_table(128, 4096, 1536, "float8_e4m3fn" + W8A8_SUFFIX, top_k=8),
    # and per-channel (--quantization fp8_w8a8_channel)
    **_reasoned_table(128, 2048, 768, "float8_e4m3fn" + W8A8_SUFFIX + CHANNEL_SUFFIX, top_k=8),
    **_reasoned_table(128, 4096, 1536, "float8_e4m3fn" + W8A8_SUFFIX + CHANNEL_SUFFIX, top_k=8),
    # Paste measured entries from `scripts/bench_kernels.py --tune-moe` below this line.
    # H100 80GB, bf16, 2026-11-25 (docs/results/gpu/tune_moe.txt): 0.244, 0.418, 0.442, 0.936 and
    # 3.07 ms per call at T = 1, 64, 256, 4096 and 16384 (the reasoned default: 1.15 ms at 4096).
    # Those runs launched every call from the host (do_bench): at T=1 that is the host's time, about
    # ten times what the 8 experts' weights take to read, so the T=1 pick among candidates was noise.
    # The tuner now times buckets up to the decode graphs' batch in a graph (bench_kernels
    # timer_for_tokens); `gpu_session.py --plan tune` re-tunes 1, 16, 64 and 256 (tune_moe_bf16_decode).
    (128, 2048, 768, 'bfloat16', 1): MoeKernelConfig(block_size_m=32, block_size_n=128, block_size_k=64, group_size_m=8, num_warps=8, num_stages=3, tuned=True),
    (128, 2048, 768, 'bfloat16', 64): MoeKernelConfig(block_size_m=16, block_size_n=128, block_size_k=128, group_size_m=1, num_warps=4, num_stages=3, tuned=True),
    (128, 2048, 768, 'bfloat16', 256): MoeKernelConfig(block_size_m=32, block_size_n=128, block_size_k=128, group_size_m=1, num_warps=8, num_stages=3, tuned=True),
    (128, 2048, 768, 'bfloat16', 4096): MoeKernelConfig(block_size_m=128, block_size_n=128, block_size_k=64, group_size_m=8, num_warps=8, num_stages=3, tuned=True),
    (128, 2048, 768, 'bfloat16', 16384): MoeKernelConfig(block_size_m=128, block_size_n=128, block_size_k=64, group_size_m=1, num_warps=8, num_stages=3, tuned=True),
    # not measured: the tile its tuned neighbours 4096 and 16384 agree on (the reasoned default's
    # 128 x 64 tiles took 1.15 ms at 4096 against 0.94 for this one); the roofline phase runs 8192
    (128, 2048, 768, 'bfloat16', 8192): MoeKernelConfig(block_size_m=128, block_size_n=128, block_size_k=64, group_size_m=8, num_warps=8, num_stages=3),
    # not measured: per-channel W8A8 at prefill sizes under VLM_CATALOG_FP8_FAST_ACCUMULATION,
    # whose K loop then runs like the bf16 one (no wait per step; without it these experts take
    # the block-scaled W8A8 tiles): the bf16 tuned tile with K doubled, the same bytes per pipeline stage. In
    # the sm_90 SASS (Triton 3.6, T=16384) it issues 0.25 / 0.39 warp instructions per 1k MACs
    # (gate/up / down) against 0.63 / 1.02 for the W8A8 default, with no spill and no full wait
    **{(128, 2048, 768, 'float8_e4m3fn' + W8A8_SUFFIX + CHANNEL_SUFFIX, bucket):
       MoeKernelConfig(block_size_m=128, block_size_n=128, block_size_k=128, group_size_m=group, num_warps=8,
                       num_stages=3)
       for bucket, group in ((4096, 8), (8192, 8), (16384, 1))},
}


def table_dtype(dtype: torch.dtype, fp8_activations: bool = False, per_channel: bool = False) -> str:
    """The table's dtype field: the experts' weight dtype, plus W8A8_SUFFIX where FP8 activations
    meet FP8 weights (the W8A8 GEMMs load half the bytes per activation tile: tiles of their own),
    plus CHANNEL_SUFFIX for per-channel FP8 experts whose K loops run like 16-bit ones
    (`fused_moe.asynchronous_k_loops`)."""
    return dtype_name(dtype) + (W8A8_SUFFIX if fp8_activations else "") + (CHANNEL_SUFFIX if per_channel else "")


def table_dtypes() -> tuple[str, ...]:
    """Every dtype field a table entry may have (`table_dtype`'s values)."""
    plain = ("bfloat16", "float16", "float32")
    fp8 = tuple(table_dtype(torch.float8_e4m3fn, w8a8, channel) for w8a8 in (False, True) for channel in (False, True))
    return plain + fp8


def get_moe_config(
    num_tokens: int,
    num_experts: int,
    hidden: int,
    intermediate: int,
    dtype: torch.dtype,
    top_k: int = 8,
    fp8_activations: bool = False,
    per_channel: bool = False,
    device: torch.device | str | None = None,
) -> MoeKernelConfig:
    """The entry for this shape and batch size (`fp8_activations`: the W8A8 entries;
    `per_channel`: the per-channel FP8 ones) from the tuned tables in effect on `device`
    (`kernels.tuned_configs`), else from MOE_CONFIGS, else the heuristic, fitted to shared
    memory for `dtype`'s element size."""
    key = (num_experts, hidden, intermediate, table_dtype(dtype, fp8_activations, per_channel),
           token_bucket(num_tokens))
    config = (tuned_configs(device).moe.get(key) or MOE_CONFIGS.get(key)
              or heuristic_moe_config(num_tokens, num_experts, top_k, dtype.itemsize))
    return fit_shared_memory(config, dtype.itemsize)


def format_config_entry(
    num_experts: int,
    hidden: int,
    intermediate: int,
    dtype: torch.dtype,
    bucket: int,
    config: MoeKernelConfig,
    fp8_activations: bool = False,
    per_channel: bool = False,
) -> str:
    """One line to paste into MOE_CONFIGS."""
    fields = ", ".join(f"{name}={value!r}" for name, value in asdict(config).items())
    key_dtype = table_dtype(dtype, fp8_activations, per_channel)
    return (
        f"    ({num_experts}, {hidden}, {intermediate}, {key_dtype!r}, {bucket}): "
        f"MoeKernelConfig({fields}),"
    )
