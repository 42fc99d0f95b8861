"""How reproducible the W8A8 fused-MoE reference is, and how far the Triton path lies from it.

A one-off GPU measurement, kept with its output (fp8_moe_reproducibility.txt): it set the
W8A8 tolerance in tests/kernels/test_fused_moe_fp8.py. Run from the repository root on a
CUDA machine: ``python3 docs/results/gpu/fp8_moe_reproducibility.py [--per-channel] [--seeds 4]``.

For the Qwen3-VL-30B-A3B expert shapes (128 x 128 scale blocks, or one scale per row and per
token with --per-channel) it prints, as max |a - b| over max |b|: the reference run on the GPU
against the same reference on the CPU (only the GEMMs' summation order differs), and the
Triton path against each, with the Triton activation quantizer and with the torch one.
"""

from __future__ import annotations

import argparse
import importlib

import torch

import kernels
from kernels.fp8 import (
    per_channel_block,
    quantize_activations_reference,
    quantize_activations_triton,
)
from tests.kernels.test_fused_moe_fp8 import fp8_inputs

# the module, not the function of the same name that `kernels.moe` exports
fused_moe_module = importlib.import_module("kernels.moe.fused_moe")


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double().cpu(), expected.double().cpu()
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-channel", action="store_true", help="one scale per weight row and per token")
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    block = per_channel_block(2048, 768) if args.per_channel else (128, 128)
    values = (torch.randn(4096, 768, device="cuda") * 3).bfloat16()
    codes_triton, scales_triton = quantize_activations_triton(values, 128)
    codes_torch, scales_torch = quantize_activations_reference(values, 128)
    mismatches = (codes_triton.view(torch.uint8) != codes_torch.view(torch.uint8)).sum().item()
    scale_difference = ((scales_triton - scales_torch).abs() / scales_torch).max().item()
    print("quantizer: code mismatches", mismatches, "of", values.numel(), "scale max rel diff", scale_difference)
    for seed in range(args.seeds):
        for num_tokens in (256, 4096):
            torch.manual_seed(seed)
            inputs, scales, _ = fp8_inputs(num_tokens, 2048, 768, 128, 8, torch.bfloat16, "cuda", block)
            for fp8_activations in (False, True):
                scales["fp8_activations"] = fp8_activations
                reference_gpu = fused_moe_module.fused_moe_reference(*inputs, **scales)
                cpu_scales = {key: value.cpu() if torch.is_tensor(value) else value for key, value in scales.items()}
                reference_cpu = fused_moe_module.fused_moe_reference(*(arg.cpu() for arg in inputs), **cpu_scales)
                triton = kernels.fused_moe(*inputs, **scales)
                triton_quantizer = fused_moe_module.quantize_activations
                fused_moe_module.quantize_activations = quantize_activations_reference
                triton_torch_quantizer = kernels.fused_moe(*inputs, **scales)
                fused_moe_module.quantize_activations = triton_quantizer
                print(f"seed {seed} T={num_tokens} w8a8={fp8_activations}: "
                      f"ref_gpu vs ref_cpu {relative(reference_gpu, reference_cpu):.2e}  "
                      f"triton vs ref_gpu {relative(triton, reference_gpu):.2e}  "
                      f"triton vs ref_cpu {relative(triton, reference_cpu):.2e}  "
                      f"triton(torch quantizer) vs ref_gpu {relative(triton_torch_quantizer, reference_gpu):.2e}",
                      flush=True)


if __name__ == "__main__":
    main()
