"""Fused ops for the Qwen3-VL-MoE serving stack.

Each op here dispatches per call (see `kernels.dispatch`): its Triton kernel when
the tensors are on CUDA and triton imports, its plain-torch reference otherwise
(the CPU serving path). Every op module also exposes `<op>_reference` and
`<op>_triton`. Importing this package does not import triton.

The package attributes named after an op are the dispatching functions, which
shadow the same-named submodules: import the variants with
``from kernels.rms_norm import rms_norm_reference`` (works), not
``import kernels.rms_norm as module`` (gives the function).
"""

from kernels.activation import silu_and_mul
from kernels.fp8_input import Fp8Input, Fp8InputLayout
from kernels.fp8_linear import fp8_linear, fp8_linear_input_layout, fp8_linear_rows
from kernels.kv_cache import PackedContexts, kv_layout, reshape_and_cache, zeros_paged_cache
from kernels.linear_gelu import linear_gelu_tanh
from kernels.moe import (
    fused_moe,
    fused_moe_input_layout,
    moe_align_block_size,
    moe_gemm_config,
    route_topk,
    route_topk_and_align,
)
from kernels.norm_router import add_rms_norm_route, add_rms_norm_router
from kernels.paged_decode_attention import (
    paged_decode_attention,
    paged_decode_attention_with_kv_write,
)
from kernels.paged_prefill_attention import paged_prefill_attention
from kernels.rms_norm import (
    fused_add_rms_norm,
    fused_sum_add_rms_norm,
    gathered_sum_add_rms_norm,
    rms_norm,
)
from kernels.rotary import QKNormRope, mrope_cos_sin, qk_norm_mrope
from kernels.skinny_linear import skinny_linear
from kernels.varlen_attention import varlen_attention
from kernels.vision_rotary import vision_rotary

__all__ = [
    "Fp8Input",
    "Fp8InputLayout",
    "PackedContexts",
    "QKNormRope",
    "add_rms_norm_route",
    "add_rms_norm_router",
    "fp8_linear",
    "fp8_linear_input_layout",
    "fp8_linear_rows",
    "fused_add_rms_norm",
    "fused_moe",
    "fused_moe_input_layout",
    "fused_sum_add_rms_norm",
    "gathered_sum_add_rms_norm",
    "kv_layout",
    "linear_gelu_tanh",
    "moe_align_block_size",
    "moe_gemm_config",
    "mrope_cos_sin",
    "paged_decode_attention",
    "paged_decode_attention_with_kv_write",
    "paged_prefill_attention",
    "qk_norm_mrope",
    "reshape_and_cache",
    "rms_norm",
    "route_topk",
    "route_topk_and_align",
    "silu_and_mul",
    "skinny_linear",
    "varlen_attention",
    "vision_rotary",
    "zeros_paged_cache",
]
