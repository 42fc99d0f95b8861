"""Launch settings of the paged decode attention's split kernel, per KV dtype, head dim and batch.

Keyed by (KV-cache dtype name, head_dim, batch bucket); a batch of B sequences
uses the entry of the smallest bucket >= B (the largest bucket above that), and
shapes without an entry use `default_decode_config`.

STATUS: no measured entries yet. The defaults are what ran on the H100 on
2026-11-25, where the kernel (as it was before the loop changes described in
jit/paged_decode_attention.py) ran at 0.64x / 0.84x / 0.98x the speed of SDPA on
gathered K/V (B=1 ctx 27k, B=32 ctx 2k, B=128 ctx 1k) and, with an FP8 cache,
read 1.1 TB/s at B=128 (37% of the copy bandwidth). `python scripts/bench_kernels.py
--tune-decode` on the target GPU times candidates under the engine's conditions
(the fused cache write, the CUDA graphs' `max_model_len` bound, contexts of 0.4-1.6x a
2k-token mean) and prints one ready-to-paste line per (dtype, batch bucket); with
`--write-table PATH` it writes them into a JSON table of that GPU model, which takes
precedence over this one (`kernels/tuned_configs.py`: `VLM_CATALOG_TUNED_CONFIGS=PATH`,
or the packaged `kernels/tuned/<GPU model>.json`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kernels.checks import dtype_name
from kernels.tuned_configs import tuned_configs

DECODE_BATCH_BUCKETS = (1, 8, 32, 64, 128, 256)
KV_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")  # the cache dtypes a key may name
MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost outweighs the parallelism (default)
PROGRAMS_PER_SM = 2  # the split count fills the GPU about this many times over (default)


@dataclass(frozen=True)
class DecodeKernelConfig:
    block_n: int  # cache positions per tile
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = PROGRAMS_PER_SM  # the split count's target (choose_num_splits)
    min_split_tokens: int = MIN_TOKENS_PER_SPLIT  # the shortest split the heuristic makes
    tuned: bool = False  # True only for values measured by `bench_kernels.py --tune-decode`

    def launch_options(self) -> dict[str, int]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


# (KV-cache dtype name, head_dim, batch bucket) -> config
DECODE_CONFIGS: dict[tuple[str, int, int], DecodeKernelConfig] = {}


def decode_batch_bucket(batch: int) -> int:
    for bucket in DECODE_BATCH_BUCKETS:
        if batch <= bucket:
            return bucket
    return DECODE_BATCH_BUCKETS[-1]


def default_decode_config(head_dim: int) -> DecodeKernelConfig:
    """Tiles of 64 positions (32 past a head dim of 128, to keep K and V tiles in registers)."""
    return DecodeKernelConfig(block_n=64 if head_dim <= 128 else 32)


def get_decode_config(kv_dtype: torch.dtype, head_dim: int, batch: int,
                      device: torch.device | str | None = None) -> DecodeKernelConfig:
    """The entry for this cache and batch from the tuned tables in effect on `device`
    (`kernels.tuned_configs`), else from DECODE_CONFIGS, else the default."""
    key = (dtype_name(kv_dtype), head_dim, decode_batch_bucket(batch))
    return tuned_configs(device).paged_decode.get(key) or DECODE_CONFIGS.get(key) or default_decode_config(head_dim)


def format_decode_config_entry(kv_dtype: torch.dtype, head_dim: int, bucket: int, config: DecodeKernelConfig) -> str:
    """One line to paste into DECODE_CONFIGS."""
    fields = ", ".join(f"{name}={value!r}" for name, value in asdict(config).items())
    return f"    ({dtype_name(kv_dtype)!r}, {head_dim}, {bucket}): DecodeKernelConfig({fields}),"
