"""Command-line options for how the engine uses the device (KV-cache dtype, FP8 experts, the
memory fraction, async scheduling, the start-up warm-up), shared by the front doors (`serve`, `extract`, `bench`) so
each spells and checks them the same way."""

from __future__ import annotations

import argparse

from vlm_catalog.engine.config import KV_CACHE_DTYPES, QUANTIZATION_MODES, EngineConfig

# the EngineConfig fields these options set
DEVICE_OPTIONS = ("kv_cache_dtype", "gpu_memory_utilization", "quantization", "async_scheduling", "warmup")
# --warmup and --async-scheduling -> EngineConfig.warmup / async_scheduling (None: on CUDA only)
AUTO_SETTINGS = {"auto": None, "on": True, "off": False}


def auto_setting(text: str) -> bool | None:
    if text not in AUTO_SETTINGS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(AUTO_SETTINGS)}, got {text!r}")
    return AUTO_SETTINGS[text]


# --async-scheduling's value: auto (None), on or off; the option alone means on (as when it was a flag)
ASYNC_SCHEDULING_OPTION = {"type": auto_setting, "nargs": "?", "const": True, "default": None,
                           "metavar": "{auto,on,off}"}


def add_device_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--kv-cache-dtype", default=EngineConfig.kv_cache_dtype, choices=("auto", *KV_CACHE_DTYPES),
        help="what the KV cache stores: auto (the model's dtype) or fp8 (e4m3: twice the tokens of bf16 "
             "in the same memory, answers may differ slightly)",
    )
    parser.add_argument(
        "--quantization", default=EngineConfig.quantization, choices=QUANTIZATION_MODES,
        help="FP8 weights: auto (an FP8 checkpoint's experts stay FP8 on CUDA), fp8 (FP8 experts "
             "anywhere; an unquantized checkpoint is quantized at load: half the expert memory), "
             "fp8_w8a8 (fp8, plus FP8 attention/dense projections and FP8 GEMM inputs: Hopper's FP8 "
             "tensor cores), fp8_w8a8_channel (fp8_w8a8 with one scale per weight row and per token "
             "instead of 128-wide blocks: the GEMMs scale once, after their K loops), none",
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=EngineConfig.gpu_memory_utilization, metavar="FRACTION",
        help="CUDA: fraction of the device's memory for weights, activations and the KV cache "
             f"(default {EngineConfig.gpu_memory_utilization})",
    )
    parser.add_argument(
        "--async-scheduling", **ASYNC_SCHEDULING_OPTION,
        help="schedule and launch each engine step before reading the previous step's tokens, so the "
             "host's per-token work overlaps the device (same answers for greedy and seeded requests; "
             "auto: on CUDA only; the option alone: on)",
    )
    parser.add_argument(
        "--warmup", type=auto_setting, default=None, metavar="{auto,on,off}",
        help="run dummy requests at start-up so the GPU kernels of every step size compile before the "
             "first real request (auto: on CUDA only)",
    )


def device_options(args: argparse.Namespace) -> dict:
    """The EngineConfig keyword arguments the options above set."""
    return {name: getattr(args, name) for name in DEVICE_OPTIONS}
