"""Compile every Triton kernel for an H100 (sm_90) without a GPU.

The interpreter tests check what the kernels compute, but the interpreter
accepts programs the GPU compiler rejects (wrong `tl.dot` shapes, type clashes
in loop-carried values, unsupported ops). Triton can compile ahead of time for
any target with its bundled ptxas, so this runs the whole GPU pipeline
(TTIR -> TTGIR -> LLVM IR -> PTX -> cubin) at the real model shapes.

Run as a script (``python -m tests.kernels.sm90_compile [--float32]``) with
TRITON_INTERPRET unset (the interpreter replaces `triton.jit` functions);
`test_sm90_compile.py` does that in a subprocess.
Exit status 0 when every kernel compiles; one line per kernel either way.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

os.environ.pop("TRITON_INTERPRET", None)

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

H100 = GPUTarget("cuda", 90, 32)
INT32_POINTERS = (
    "block_tables",
    "context_lens",
    "cu_seqlens",
    "topk_ids",
    "sorted_token_ids",
    "expert_ids",
    "num_tokens_post_padded",
    "counts",
)
INT64_POINTERS = ("slot_mapping", "positions")
FLOAT32_POINTERS = ("inv_freq", "partial_", "topk_weights", "_scale")
FLOAT_SCALARS = ("eps", "scale_log2")


FP8_CACHE = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}  # an FP8 (e4m3) paged KV cache


def signature(kernel, dtype: str, constexprs: dict, pointer_types: dict | None = None) -> dict[str, str]:
    """Argument types from argument names: pointers of `dtype` unless the name says otherwise
    or `pointer_types` names the argument."""
    types = {}
    for name in kernel.arg_names:
        if pointer_types and name in pointer_types:
            types[name] = pointer_types[name]
        elif name in constexprs:
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            if any(part in name for part in INT32_POINTERS):
                types[name] = "*i32"
            elif any(part in name for part in INT64_POINTERS):
                types[name] = "*i64"
            elif any(part in name for part in FLOAT32_POINTERS):
                types[name] = "*fp32"
            else:
                types[name] = f"*{dtype}"
        elif name in FLOAT_SCALARS:
            types[name] = "fp32"
        else:
            types[name] = "i32"
    return types


def kernel_specs(include_float32: bool):
    """(label, kernel, pointer dtype, constexprs, launch options[, pointer types]) at
    Qwen3-VL-30B-A3B shapes; the attention and cache-write kernels also with an FP8 cache.
    float32 attention (exact `tl.dot`, for float32 parity runs) compiles slowly: opt-in."""
    from kernels.fp8 import fp8_block_k
    from kernels.fp8_linear import dense_fp8_config
    from kernels.jit.activation import silu_and_mul_kernel
    from kernels.jit.fp8_linear import fp8_linear_kernel
    from kernels.jit.fp8_quant import quantize_activations_kernel
    from kernels.jit.fused_moe import moe_down_kernel, moe_gate_up_silu_kernel
    from kernels.jit.kv_cache import reshape_and_cache_kernel
    from kernels.jit.moe_align import moe_count_kernel, moe_scatter_kernel
    from kernels.jit.moe_routing import route_topk_align_kernel, route_topk_kernel
    from kernels.jit.paged_decode_attention import (
        paged_decode_reduce_kernel,
        paged_decode_split_kernel,
    )
    from kernels.jit.paged_prefill_attention import paged_prefill_attention_kernel
    from kernels.jit.rms_norm import rms_norm_kernel
    from kernels.jit.rotary import qk_norm_mrope_kernel
    from kernels.jit.varlen_attention import varlen_attention_kernel
    from kernels.jit.vision_rotary import vision_rotary_kernel
    from kernels.moe.configs import heuristic_moe_config

    specs = [
        (
            "rms_norm",
            rms_norm_kernel,
            "bf16",
            {"BLOCK_SIZE": 2048, "ADD_RESIDUAL": False, "NUM_TERMS": 1},
            {"num_warps": 8},
        ),
        (
            "fused_add_rms_norm",
            rms_norm_kernel,
            "bf16",
            {"BLOCK_SIZE": 2048, "ADD_RESIDUAL": True, "NUM_TERMS": 1},
            {"num_warps": 8},
        ),
        (
            "fused_sum_add_rms_norm[K=8]",  # the fused MoE's 8 expert terms summed in the next norm
            rms_norm_kernel,
            "bf16",
            {"BLOCK_SIZE": 2048, "ADD_RESIDUAL": True, "NUM_TERMS": 8},
            {"num_warps": 8},
        ),
        (
            "qk_norm_mrope",
            qk_norm_mrope_kernel,
            "bf16",
            {
                "HEAD_DIM": 128,
                "BLOCK_HALF": 64,
                "BLOCK_Q_HEADS": 32,
                "BLOCK_KV_HEADS": 4,
                "SECTION_H": 20,
                "SECTION_W": 20,
            },
            {"num_warps": 4},
        ),
        (
            "vision_rotary[D=72]",
            vision_rotary_kernel,
            "bf16",
            {"HEAD_DIM": 72, "BLOCK_HALF": 64, "BLOCK_HEADS": 16},
            {"num_warps": 4},
            {"cos_ptr": "*fp32", "sin_ptr": "*fp32"},
        ),
        ("silu_and_mul", silu_and_mul_kernel, "bf16", {"BLOCK_SIZE": 1024}, {"num_warps": 4}),
        (
            "quantize_activations[fp8]",
            quantize_activations_kernel,
            "bf16",
            {"GROUP": 128, "BLOCK_ROWS": 32},
            {"num_warps": 4},
            {"quantized_ptr": "*fp8e4nv"},
        ),
        (
            "reshape_and_cache",
            reshape_and_cache_kernel,
            "bf16",
            {"HEAD_DIM": 128, "BLOCK_HEADS": 4, "BLOCK_D": 128, "SATURATE_FP8": False},
            {"num_warps": 4},
        ),
        (
            "reshape_and_cache[fp8 cache]",
            reshape_and_cache_kernel,
            "bf16",
            {"HEAD_DIM": 128, "BLOCK_HEADS": 4, "BLOCK_D": 128, "SATURATE_FP8": True},
            {"num_warps": 4},
            FP8_CACHE,
        ),
        (
            "route_topk",
            route_topk_kernel,
            "bf16",
            {"TOP_K": 8, "BLOCK_K": 8, "BLOCK_EXPERTS": 128, "RENORMALIZE": True},
            {"num_warps": 1},
        ),
        (
            "route_topk[bf16 weights]",  # as the model calls it: weights in the hidden dtype
            route_topk_kernel,
            "bf16",
            {"TOP_K": 8, "BLOCK_K": 8, "BLOCK_EXPERTS": 128, "RENORMALIZE": True},
            {"num_warps": 1},
            {"topk_weights_ptr": "*bf16"},
        ),
        *(
            (
                f"route_topk_align[T={tokens}]",  # a decode batch's routing and align in one launch
                route_topk_align_kernel,
                "bf16",
                {"TOP_K": 8, "BLOCK_K": 8, "BLOCK_T": tokens, "BLOCK_EXPERTS": 128, "RENORMALIZE": True,
                 "BLOCK": max(tokens, 16)},
                {"num_warps": max(1, tokens // 2)},  # as route_topk_and_align_triton launches it
                {"topk_weights_ptr": "*bf16"},
            )
            for tokens in (1, 32)
        ),
        ("moe_count", moe_count_kernel, "bf16", {"BLOCK": 1024}, {"num_warps": 4}),
        (
            "moe_scatter",
            moe_scatter_kernel,
            "bf16",
            {"BLOCK": 1024, "BLOCK_EXPERTS": 128, "COUNT_HERE": False, "COUNT_BLOCK": 64},
            {"num_warps": 4},
        ),
        (
            "moe_scatter[counts here, T=1]",  # a decode token's align in one launch
            moe_scatter_kernel,
            "bf16",
            {"BLOCK": 8, "BLOCK_EXPERTS": 128, "COUNT_HERE": True, "COUNT_BLOCK": 8},
            {"num_warps": 4},
        ),
        (
            "moe_scatter[counts here, T=32]",
            moe_scatter_kernel,
            "bf16",
            {"BLOCK": 256, "BLOCK_EXPERTS": 128, "COUNT_HERE": True, "COUNT_BLOCK": 64},
            {"num_warps": 4},
        ),
        (
            "paged_decode_reduce",
            paged_decode_reduce_kernel,
            "bf16",
            {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_SPLITS": 64},
            {"num_warps": 4},
        ),
    ]
    attention_dtypes = [("bf16", "tf32")] + ([("fp32", "ieee")] if include_float32 else [])
    for dtype, precision in attention_dtypes:
        for cache, cache_types in (("", None), (",fp8 cache", FP8_CACHE)):
            for fuse, single in ((False, False), (True, False), (True, True)):  # single: no reduce launch
                specs.append(
                    (
                        f"paged_decode_split[{dtype}{cache},fuse={fuse}{',single split' if single else ''}]",
                        paged_decode_split_kernel,
                        dtype,
                        {
                            "HEAD_DIM": 128,
                            "BLOCK_D": 128,
                            "BLOCK_G": 16,
                            "BLOCK_N": 64,
                            "FUSE_CACHE_WRITE": fuse,
                            "SATURATE_FP8": cache_types is not None,
                            "DOT_PRECISION": precision,
                            "SINGLE_SPLIT": single,
                        },
                        {"num_warps": 4, "num_stages": 2},
                        cache_types,
                    )
                )
            specs.append(
                (
                    f"paged_prefill[{dtype}{cache}]",
                    paged_prefill_attention_kernel,
                    dtype,
                    {
                        "HEAD_DIM": 128,
                        "BLOCK_D": 128,
                        "BLOCK_M": 64,
                        "BLOCK_N": 64,
                        "DOT_PRECISION": precision,
                    },
                    {"num_warps": 4, "num_stages": 2},
                    cache_types,
                )
            )
    specs.append(
        (
            "varlen_attention[bf16,D=72]",
            varlen_attention_kernel,
            "bf16",
            {"HEAD_DIM": 72, "BLOCK_D": 128, "BLOCK_M": 64, "BLOCK_N": 64, "DOT_PRECISION": "tf32"},
            {"num_warps": 4, "num_stages": 2},
        )
    )
    for num_tokens in (1, 256, 8192):
        config = heuristic_moe_config(num_tokens, 128, 8)
        # bf16 experts; FP8 experts (128 x 128 scale blocks); FP8 experts and FP8 activations
        for variant in ("", "fp8 experts", "w8a8"):
            fp8 = variant != ""
            meta = {
                "BLOCK_M": config.block_size_m,
                "BLOCK_N": config.block_size_n,
                "BLOCK_K": fp8_block_k(config.block_size_k, 128) if fp8 else config.block_size_k,
                "GROUP_M": config.group_size_m,
                "DOT_PRECISION": "tf32",
                "FP8_WEIGHTS": fp8,
                "FP8_ACTIVATIONS": variant == "w8a8",
                "QUANT_N": 128 if fp8 else 1,
                "QUANT_K": 128 if fp8 else 1,
            }
            for label, kernel, weight, inputs in (
                ("moe_gate_up_silu", moe_gate_up_silu_kernel, "w13_ptr", "hidden_ptr"),
                ("moe_down", moe_down_kernel, "w2_ptr", "activated_ptr"),
            ):
                pointer_types = {weight: "*fp8e4nv"} if fp8 else None
                if variant == "w8a8":
                    pointer_types[inputs] = "*fp8e4nv"
                specs.append((
                    f"{label}[T={num_tokens}{',' + variant if variant else ''}]", kernel, "bf16", meta,
                    config.launch_options(), pointer_types,
                ))
    for num_tokens in (1, 256, 8192):  # the dense FP8 linear (qkv_proj / o_proj), W8A16 and W8A8
        config = dense_fp8_config(num_tokens)
        for variant in ("fp8 weights", "w8a8"):
            pointer_types = {"w_ptr": "*fp8e4nv", "x_ptr": "*fp8e4nv" if variant == "w8a8" else "*bf16"}
            meta = {
                "BLOCK_M": config.block_size_m,
                "BLOCK_N": config.block_size_n,
                "BLOCK_K": fp8_block_k(config.block_size_k, 128),
                "GROUP_M": config.group_size_m,
                "DOT_PRECISION": "tf32",
                "FP8_ACTIVATIONS": variant == "w8a8",
                "HAS_BIAS": num_tokens == 256,  # once with a bias
                "QUANT_N": 128,
                "QUANT_K": 128,
            }
            specs.append((f"fp8_linear[T={num_tokens},{variant}]", fp8_linear_kernel, "bf16", meta,
                          config.launch_options(), pointer_types))
    return specs


def main(argv: list[str]) -> int:
    failures = 0
    for label, kernel, dtype, constexprs, options, *pointer_types in kernel_specs(
        include_float32="--float32" in argv
    ):
        start = time.perf_counter()
        try:
            types = signature(kernel, dtype, constexprs, *pointer_types)
            source = ASTSource(kernel, types, constexprs=constexprs)
            compiled = triton.compile(source, target=H100, options=options)
            status = f"ok ({len(compiled.asm['cubin'])} bytes of cubin)"
        except Exception:  # noqa: BLE001 - report every kernel, then fail
            failures += 1
            status = "FAILED\n" + traceback.format_exc()
        print(f"{label}: {status} [{time.perf_counter() - start:.1f}s]", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
