"""Fused mixture-of-experts, in stages: routing (`route_topk`), grouping the
(token, k) pairs by expert (`moe_align_block_size`), and the two grouped GEMMs
(`fused_moe`). `configs` holds the GEMM block sizes per shape and batch size."""

from kernels.moe.align import moe_align_block_size
from kernels.moe.configs import MoeKernelConfig, get_moe_config
from kernels.moe.fused_moe import fused_moe
from kernels.moe.routing import route_topk

__all__ = ["MoeKernelConfig", "fused_moe", "get_moe_config", "moe_align_block_size", "route_topk"]
