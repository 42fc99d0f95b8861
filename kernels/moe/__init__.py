"""Fused mixture-of-experts, in stages: routing (`route_topk`), grouping the
(token, k) pairs by expert (`moe_align_block_size`), and the two grouped GEMMs
(`fused_moe`). For decode batches `route_topk_and_align` does the first two in
one launch. `configs` holds the GEMM block sizes per shape and batch size."""

from kernels.moe.align import MoeAlignment, moe_align_block_size
from kernels.moe.configs import MoeKernelConfig, get_moe_config
from kernels.moe.fused_moe import fused_moe, fused_moe_input_layout, moe_gemm_config
from kernels.moe.routing import route_topk, route_topk_and_align

__all__ = [
    "MoeAlignment",
    "MoeKernelConfig",
    "fused_moe",
    "fused_moe_input_layout",
    "get_moe_config",
    "moe_align_block_size",
    "moe_gemm_config",
    "route_topk",
    "route_topk_and_align",
]
