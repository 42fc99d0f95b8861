#!/usr/bin/env python
"""GPU benchmark at Qwen3-VL-30B-A3B scale with random bf16 weights made on the GPU (no download).

Workload: the synthetic catalogue at realistic image sizes (500-2000 px JPEGs),
the mlperf prompt, answers capped at 150 tokens. Phases (run together, or
separately with --phases to stay within a time limit; --json merges into an
existing file):

- ceilings   measured device copy bandwidth and bf16 matmul peak
- kernels    each Triton kernel against its torch reference at the model's shapes
             (scripts/bench_kernels.py): fused MoE vs a per-expert loop at 256
             tokens (target >= 3x), paged decode vs SDPA on gathered K/V (target >= 1x)
- roofline   decode step at batch 1 against the memory-bandwidth floor (active
             weight bytes / copy bandwidth; target within 1.5x) and prefill MFU
             against the measured matmul peak (target >= 40%)
- engine     offline samples/s, prefill and decode tokens/s: fixed 150 output
             tokens (ignore_eos), and the real stop condition (per-record schema)
- transformers  transformers generate (bf16, sdpa) at the best batch size that
             fits, on the same inputs (target: ours >= 10x)
Also: peak GPU memory and the KV-cache capacity in tokens.

    python scripts/bench_gpu.py --records 256 --json gpu.json
    python scripts/bench_gpu.py --tiny --device cpu --records 4   # smoke test of the code paths
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from vlm_catalog.bench.random_model import (
    QWEN3_VL_30B_A3B,
    benchmark_checkpoint_dir,
    random_model,
    random_transformers_model,
)
from vlm_catalog.data.loader import load_catalogue
from vlm_catalog.data.synthetic.generator import make_catalog
from vlm_catalog.engine.config import EngineConfig
from vlm_catalog.engine.llm_engine import LLMEngine
from vlm_catalog.engine.paged_attention import (
    PagedAttention,
    PagedAttentionMetadata,
    PrefillBatch,
    allocate_kv_caches,
)
from vlm_catalog.engine.sampling_params import SamplingParams
from vlm_catalog.paths import DEFAULT_MODEL_DIR, REPO_ROOT
from vlm_catalog.preprocess.prompt import build_messages
from vlm_catalog.structured import catalogue_schema

PHASES = ("ceilings", "kernels", "roofline", "engine", "transformers")
OUTPUT_TOKENS = 150


# ------------------------------------------------------------------------ helpers
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(function, device: torch.device, repeats: int = 10, warmup: int = 3) -> float:
    """Median seconds of `function()` over `repeats` runs after `warmup`."""
    for _ in range(warmup):
        function()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure_ceilings(device: torch.device) -> dict:
    size = 2**30 if device.type == "cuda" else 2**26  # bytes copied
    source = torch.empty(size // 2, dtype=torch.bfloat16, device=device).normal_()
    target = torch.empty_like(source)
    copy_seconds = timed(lambda: target.copy_(source), device)
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    matmul_seconds = timed(lambda: a @ b, device)
    return {
        "copy_bandwidth_bytes_per_s": 2 * size / copy_seconds,  # read + write
        "bf16_matmul_flops_per_s": 2 * n**3 / matmul_seconds,
    }


def active_parameters(model) -> int:
    """Weights one decode token reads: all text weights but the embedding table, top-k experts per MoE layer."""
    text = model.config.text
    total = 0
    for name, parameter in model.named_parameters():
        if name.startswith("visual."):
            continue
        if ".experts." in name:
            total += parameter.numel() // text.num_experts * text.num_experts_per_tok
        elif "embed_tokens" in name:
            total += text.hidden_size  # one row is read
        else:
            total += parameter.numel()
    return total


def active_weight_bytes(model) -> int:
    return active_parameters(model) * model.dtype.itemsize


def prefill_flops(model, tokens: int) -> float:
    text = model.config.text
    active_params = active_parameters(model)
    attention = 2 * text.num_layers * text.num_heads * text.head_dim * tokens * tokens  # causal QK^T and PV
    return 2 * active_params * tokens + attention


def measure_roofline(model, device: torch.device, ceilings: dict) -> dict:
    text = model.config.text
    block_size = 16
    tokens = 8192 if device.type == "cuda" else 256
    caches = allocate_kv_caches(text.num_layers, tokens // block_size + 8, block_size, text.num_kv_heads,
                                text.head_dim, model.dtype, device)
    ids = torch.randint(10, 1000, (tokens,), device=device)
    positions = torch.arange(tokens, device=device).unsqueeze(0).expand(3, -1)
    prefill = PrefillBatch(
        slot_mapping=torch.arange(tokens, device=device),
        block_tables=torch.arange(tokens // block_size, dtype=torch.int32, device=device)[None],
        cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=device),
        context_lens=torch.tensor([tokens], dtype=torch.int32, device=device),
        max_query_len=tokens,
    )
    metadata = PagedAttentionMetadata(decode=None, prefill=prefill)
    prefill_seconds = timed(lambda: model(ids, positions, PagedAttention(caches, metadata)), device, repeats=3, warmup=1)
    flops = prefill_flops(model, tokens)

    from vlm_catalog.engine.cuda_graphs import DecodeGraphRunner

    graphs = DecodeGraphRunner(model, caches, max_batch=1, max_blocks_per_sequence=tokens // block_size,
                               max_context_len=tokens, buckets=[1])
    graphs.capture()
    decode_args = (
        torch.tensor([7], device=device), torch.full((3, 1), 100, device=device),
        torch.tensor([100], device=device), prefill.block_tables, torch.tensor([101], dtype=torch.int32, device=device),
    )
    decode_seconds = timed(lambda: graphs.run(*decode_args), device, repeats=20)
    floor = active_weight_bytes(model) / ceilings["copy_bandwidth_bytes_per_s"]
    return {
        "prefill_tokens": tokens,
        "prefill_seconds": prefill_seconds,
        "prefill_tokens_per_s": tokens / prefill_seconds,
        "prefill_mfu": flops / prefill_seconds / ceilings["bf16_matmul_flops_per_s"],
        "decode_batch1_seconds": decode_seconds,
        "decode_bandwidth_floor_seconds": floor,
        "decode_over_floor": decode_seconds / floor,
        "active_weight_bytes": active_weight_bytes(model),
        "cuda_graphs": bool(graphs.graphs),
    }


def run_engine(engine: LLMEngine, conversations, params) -> tuple[float, list]:
    for index, (messages, param) in enumerate(zip(conversations, params)):
        engine.add_request(messages, param, f"bench-{index}-{time.monotonic_ns()}")
    outputs = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs += [output for output in engine.step() if output.finished]
    return time.perf_counter() - start, outputs


def measure_engine(checkpoint: Path, model, device: torch.device, records, dtype: str) -> dict:
    config = EngineConfig(model=checkpoint, device=str(device), dtype=dtype, max_num_seqs=256,
                          max_num_batched_tokens=16384, enable_prefix_caching=False,
                          scheduling_policy="shortest_prompt_first", max_model_len=32768)
    engine = LLMEngine(config, prebuilt_model=model)
    conversations = [build_messages(record) for record in records]
    results = {"kv_cache_tokens": engine.num_blocks * config.block_size}
    fixed = [SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True)] * len(records)
    constrained = [SamplingParams(max_tokens=OUTPUT_TOKENS, json_schema=catalogue_schema(r.candidate_categories))
                   for r in records]
    for name, params in (("fixed_150_tokens", fixed), ("constrained_real_stop", constrained)):
        before = dict(engine.stats.as_dict())
        seconds, outputs = run_engine(engine, conversations, params)
        stats = engine.stats.as_dict()
        delta = {key: stats[key] - before[key] for key in stats}
        generated = sum(len(o.token_ids) for o in outputs)
        results[name] = {
            "seconds": seconds,
            "samples_per_s": len(outputs) / seconds,
            "generated_tokens": generated,
            "prompt_tokens": delta["num_prompt_tokens_computed"],
            "prefill_tokens_per_s": delta["num_prompt_tokens_computed"] / max(delta["seconds_in_prefill_steps"], 1e-9),
            "decode_tokens_per_s": delta["num_output_tokens_computed"] / max(delta["seconds_in_decode_steps"], 1e-9),
            "model_steps": delta["num_steps"],
            "errors": sum(o.finish_reason == "error" for o in outputs),
        }
    engine.close()
    if device.type == "cuda":
        results["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    return results


def measure_transformers(checkpoint: Path, device: torch.device, records, batch_sizes: list[int]) -> dict:
    from vlm_catalog.bench.baselines import TransformersPipeline

    model = random_transformers_model(checkpoint, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    pipeline = TransformersPipeline(checkpoint, model=model)
    conversations = [build_messages(record) for record in records]
    results = {}
    for batch in batch_sizes:
        try:
            start = time.perf_counter()
            for first in range(0, len(conversations), batch):
                pipeline.generate(conversations[first : first + batch], OUTPUT_TOKENS)
            synchronize(device)
            seconds = time.perf_counter() - start
            results[f"batch_{batch}"] = {"seconds": seconds, "samples_per_s": len(conversations) / seconds}
        except torch.OutOfMemoryError:
            results[f"batch_{batch}"] = "out of memory"
            gc.collect()
            torch.cuda.empty_cache()
    timings = [v["samples_per_s"] for v in results.values() if isinstance(v, dict)]
    results["best_samples_per_s"] = max(timings) if timings else None
    return results


def load_bench_kernels():
    """scripts/bench_kernels.py as a module (it is a script, not a package member).

    Registered in sys.modules before it runs: its dataclasses look their module up
    there while they are being defined, and fail without the entry.
    """
    name = "bench_kernels"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / "bench_kernels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def kernel_benchmarks(device: torch.device) -> dict:
    """The kernel table at the model's shapes on CUDA; on CPU the interpreter smoke shapes."""
    bench_kernels = load_bench_kernels()
    if device.type == "cuda":
        return bench_kernels.run_kernel_benchmarks(device)
    return bench_kernels.run_kernel_benchmarks(device, bench_kernels.TINY_SHAPES)


# ------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=256)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {', '.join(PHASES)}")
    parser.add_argument("--hf-batch-sizes", default="1,4,16,32")
    parser.add_argument("--tiny", action="store_true", help="the default model's shapes (smoke test)")
    parser.add_argument("--json", dest="json_out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here: run on a GPU machine, or --tiny --device cpu for a smoke test")
        return 0
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases: {', '.join(sorted(unknown))}")
    if device.type == "cpu" and "kernels" in phases:
        # the kernels run under the Triton interpreter on CPU; it is chosen when kernels.jit is
        # first imported, which has not happened yet (only the Triton wrappers import it)
        if "kernels.jit" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("the kernels phase on CPU needs TRITON_INTERPRET=1 set before triton is used")
        os.environ["TRITON_INTERPRET"] = "1"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = json.loads(args.json_out.read_text()) if args.json_out and args.json_out.is_file() else {}
    results["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results["date"] = time.strftime("%Y-%m-%d")

    with tempfile.TemporaryDirectory() as scratch:
        shapes = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text()) if args.tiny else QWEN3_VL_30B_A3B
        if args.tiny:
            shapes = {key: shapes[key] for key in ("text_config", "vision_config", "tie_word_embeddings")}
        checkpoint = benchmark_checkpoint_dir(Path(scratch) / "checkpoint", shapes)
        needs_records = {"engine", "transformers"} & set(phases)
        records = []
        if needs_records:
            catalogue = make_catalog(Path(scratch) / "catalogue", args.records, args.seed, image_size="realistic")
            records = list(load_catalogue(catalogue))
        if "ceilings" in phases or ("roofline" in phases and "ceilings" not in results):
            results["ceilings"] = measure_ceilings(device)
            print("ceilings:", results["ceilings"], flush=True)
        if "kernels" in phases:
            results["kernels"] = kernel_benchmarks(device)
            print("kernels:", results["kernels"], flush=True)
        if {"roofline", "engine"} & set(phases):
            model = random_model(checkpoint, device, dtype)
            if "roofline" in phases:
                results["roofline"] = measure_roofline(model, device, results["ceilings"])
                print("roofline:", results["roofline"], flush=True)
            if "engine" in phases:
                results["engine"] = measure_engine(checkpoint, model, device, records, "bfloat16" if device.type == "cuda" else "float32")
                print("engine:", results["engine"], flush=True)
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if "transformers" in phases:
            sizes = [int(s) for s in args.hf_batch_sizes.split(",")]
            results["transformers"] = measure_transformers(checkpoint, device, records, sizes)
            print("transformers:", results["transformers"], flush=True)
    engine_rate = results.get("engine", {}).get("fixed_150_tokens", {}).get("samples_per_s")
    hf_rate = results.get("transformers", {}).get("best_samples_per_s")
    if engine_rate and hf_rate:
        results["speedup_vs_transformers"] = engine_rate / hf_rate
        print(f"ours / transformers: {results['speedup_vs_transformers']:.1f}x")
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
