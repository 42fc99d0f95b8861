#!/usr/bin/env python
"""GPU benchmark at Qwen3-VL-30B-A3B scale with random bf16 weights made on the GPU (no download).

Workload: the synthetic catalogue at realistic image sizes (500-2000 px JPEGs),
the mlperf prompt, answers capped at 150 tokens. Each phase runs alone
(`--phase NAME`, or several with `--phases a,b`) within one 10-minute device
call; `--json FILE` merges the phases' results into FILE.

- ceilings        measured device copy bandwidth and matmul peak (bf16 on CUDA)
- kernels         each Triton kernel against its torch reference at the model's shapes
                  (scripts/bench_kernels.py; on CPU the interpreter's tiny shapes)
- roofline        decode step at batch 1 against the memory-bandwidth floor (active
                  weight bytes / copy bandwidth; target within 1.5x) and prefill MFU
                  against the measured matmul peak (target >= 50%)
- vision_encoder  the vision tower alone on realistic images: seconds, patches, FLOPs
                  and MFU against the matmul peak (target >= 35%)
- engine          offline samples/s, prefill and decode tokens/s with 150 output tokens
                  (ignore_eos), sampled as the benchmark samples (temperature 0.7, top-p 0.8,
                  top-k 20; `--engine-sampling greedy` for argmax, as the first H100 run);
                  the KV capacity in tokens and the memory profile. `--async-scheduling
                  {auto,on,off}`: whether the engine phases schedule and launch each step
                  before reading the previous step's tokens (auto, the engine's default: on
                  CUDA; recorded as `async_scheduling`, as the engine resolved it). Every engine
                  phase (constrained too) first runs `--warmup-records` (32 on CUDA) other
                  records untimed (recorded as `warmup`): a process's first steps compile kernels
- engine_fp8_kv   the same with an FP8 (e4m3) KV cache: twice the tokens in the same memory,
                  so more records decode together
- engine_fp8      FP8 experts (128 x 128 block scales, as Qwen's -FP8 checkpoints; the random
                  experts are quantized in place, so this runs after the other model phases)
                  and an FP8 KV cache: ~30 GB of weights instead of ~61, the rest for the cache
- engine_w8a8     engine_fp8 with the decoder's dense projections in FP8 too and every FP8
                  GEMM's input quantized (FP8 tensor cores; `--quantization fp8_w8a8`)
- engine_w8a8_channel  engine_w8a8 with one scale per weight row and per token instead of
                  128-wide blocks (`--quantization fp8_w8a8_channel`): the GEMMs scale after
                  their K loops (requantized in place); their sums go into float32 every K step
- engine_w8a8_channel_fast  the same with VLM_CATALOG_FP8_FAST_ACCUMULATION=1: the FP8 GEMMs
                  sum their whole K loop in the tensor core's accumulator (vLLM's way), so
                  Hopper's wgmma runs asynchronously, with fewer bits than float32
- engine_w8a8_channel_grouped_mm  engine_w8a8_channel with VLM_CATALOG_MOE_GEMM=grouped_mm: the
                  experts of prefill-sized steps on torch's grouped GEMMs (CUTLASS) instead of
                  the Triton kernels, where they pass their first-call check
                  (kernels/moe/grouped_gemm.py; `moe_grouped_gemm` records the verdicts)
- engine_w8a8_channel_fa3  engine_w8a8_channel with VLM_CATALOG_FLASH_VARLEN=fa3: the vision
                  tower's and whole prompts' attention through FlashAttention 3 (kernels/flash_varlen.py),
                  where it loads (`flash_varlen` in the phase records which kernel ran); the
                  default (`auto`) is the same where FA3 is installed on a Hopper GPU
- engine_w8a8_channel_fa2  engine_w8a8_channel with VLM_CATALOG_FLASH_VARLEN=torch: PyTorch's
                  FlashAttention 2 varlen call, the default before 2026-11-27's H200 run
- engine_w8a8_channel_tuned  engine_w8a8_channel with the tuned table --tuned-configs names
                  (VLM_CATALOG_TUNED_CONFIGS: the MoE tiles and decode attention launch settings
                  the tuners just wrote, kernels/tuned_configs.py), against the tables in effect
                  without it; every engine run records the tables it read (`tuned_configs`)
- engine_profile  engine_w8a8_channel on the first --profile-records (128) records under
                  torch.profiler: the device's kernel time by region of the step (vision,
                  text forward in prefill and decode steps, the rest of the step), by kind
                  (attention, MoE, GEMM, ...) and by kernel, and how busy the device was
                  (vlm_catalog/bench/device_profile.py). Every engine run also records its
                  `device_seconds`: the same regions from CUDA events, without a profiler
- constrained     the per-record schema (real stop) against an unconstrained run that
                  generates the same number of tokens per record (both counts reported;
                  target >= 0.95x); with --repeat-runs 2 the constrained run once more
                  after the unconstrained one (`constrained_again`), so that neither
                  compared run is the process's first timed run
- constrained_w8a8_channel  the same comparison on the engine as it is served fastest:
                  per-channel W8A8 weights and an FP8 KV cache (engine_w8a8_channel's), so
                  every record decodes at once, as in the throughput runs, instead of the
                  bf16 model's ~40 (its ~94k-token cache)
- transformers    transformers generate (bf16, sdpa) on the first --hf-records records:
                  a batch-1 probe measures activation bytes per token, the batch size is
                  chosen from that and the free memory, halved on out-of-memory; stops at
                  --hf-time-limit-s (target: ours >= 10x)

A phase that raises (a crash, an out-of-memory) is recorded as {"error": ...} and the
phases after it still run; the exit status is then 1. So is a kernels phase with a
failed group of rows (its "errors").

    python scripts/bench_gpu.py --records 256 --json gpu.json                 # every phase
    python scripts/bench_gpu.py --phase vision_encoder --json gpu.json        # one phase
    python scripts/bench_gpu.py --tiny --device cpu --records 4 --phase engine  # CPU smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from kernels import fp8_linear_cublas, linear_gelu
from kernels.dispatch import (
    KERNELS_OFF_ENV_VAR,
    environment_variable,
    fp8_accumulation,
    kernels_off,
)
from kernels.flash_varlen import FLASH_VARLEN_ENV_VAR, flash_varlen_module
from kernels.fp8 import per_channel_block
from kernels.kv_cache import kv_layout
from kernels.moe import grouped_gemm
from kernels.moe.grouped_gemm import moe_gemm_choice
from kernels.pdl import pdl_requested, programmatic_dependent_launch
from kernels.sdpa_backend import sdpa_backend
from kernels.tuned_configs import TUNED_CONFIGS_ENV_VAR, TunedTableError, load_table
from vlm_catalog.bench.device_profile import profiled_call
from vlm_catalog.bench.random_model import (
    QWEN3_VL_30B_A3B,
    benchmark_checkpoint_dir,
    random_model,
    random_transformers_model,
    random_vision_tower,
)
from vlm_catalog.bench.routing_stats import RoutingRecorder
from vlm_catalog.bench.run_diagnostics import RunDiagnostics
from vlm_catalog.data.loader import load_catalogue
from vlm_catalog.data.synthetic.generator import make_catalog
from vlm_catalog.engine.arguments import ASYNC_SCHEDULING_OPTION
from vlm_catalog.engine.config import EngineConfig
from vlm_catalog.engine.generation_config import GREEDY, QWEN3_VL_SAMPLING, Sampling
from vlm_catalog.engine.llm_engine import LLMEngine
from vlm_catalog.engine.paged_attention import (
    PagedAttention,
    PagedAttentionMetadata,
    PrefillBatch,
    allocate_kv_caches,
)
from vlm_catalog.engine.sampling_params import SamplingParams
from vlm_catalog.model.fp8 import Fp8BlockQuantization, fitting_block
from vlm_catalog.model.text import Fp8Linear, dense_input_widths, dense_row_counts
from vlm_catalog.paths import DEFAULT_MODEL_DIR, REPO_ROOT
from vlm_catalog.preprocess.prompt import build_messages
from vlm_catalog.structured import catalogue_schema

PHASES = ("ceilings", "kernels", "roofline", "vision_encoder", "engine", "engine_fp8_kv", "constrained",
          "engine_fp8", "engine_w8a8", "engine_w8a8_channel", "engine_w8a8_channel_grouped_mm", "engine_w8a8_channel_fast",
          "engine_w8a8_channel_fa3", "engine_w8a8_channel_fa2", "engine_w8a8_channel_tuned", "constrained_w8a8_channel",
          "engine_profile",
          "transformers")  # engine_profile last of the engines: its analysis is the longest
# they quantize the experts in place: after the others
FP8_MODEL_PHASES = {"engine_fp8", "engine_w8a8", "engine_w8a8_channel", "engine_w8a8_channel_fast", "engine_profile",
                    "engine_w8a8_channel_grouped_mm", "engine_w8a8_channel_fa3", "engine_w8a8_channel_fa2",
                    "engine_w8a8_channel_tuned",
                    "constrained_w8a8_channel"}
NEEDS_RECORDS = {"vision_encoder", "engine", "engine_fp8_kv", "constrained", "transformers", *FP8_MODEL_PHASES}
NEEDS_MODEL = {"roofline", "engine", "engine_fp8_kv", "constrained", *FP8_MODEL_PHASES}
ENGINE_PHASES = NEEDS_MODEL - {"roofline"}  # they run the engine, after a warm-up (`warm_up`)
OUTPUT_TOKENS = 150
# an output only when a request finishes, as the offline front doors (LLM.generate, the batch job,
# the LoadGen harness) ask: a per-step output for each of 256 requests cost about 3 ms of host
# time per step on the CPU (docs/benchmarks.md, "Host time per engine step"); until 2026-11-27
# the engine phases asked for them
OFFLINE_OUTPUTS = "final_only"


# ------------------------------------------------------------------------ helpers
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device) -> None:
    """Free what dropped objects still hold (engines have reference cycles) and return it to the device.
    Run as a script, the collection looks only at objects made after the imports (`gc.freeze`)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


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


def measure_ceilings(device: torch.device, dtype: torch.dtype) -> dict:
    """Copy bandwidth, and the matmul rate in `dtype`, the one the model phases run in (bf16 on
    CUDA, float32 on CPU: a CPU without bf16 units took 2.5 s per bf16 1024^3 product, a
    ceiling the float32 phases have nothing to do with). The MFUs divide by this rate."""
    size = 2**30 if device.type == "cuda" else 2**26  # bytes copied
    source = torch.empty(size // 2, dtype=torch.bfloat16, device=device).normal_()
    target = torch.empty_like(source)
    copy_seconds = timed(lambda: target.copy_(source), device)
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    matmul_seconds = timed(lambda: a @ b, device)
    return {
        "copy_bandwidth_bytes_per_s": 2 * size / copy_seconds,  # read + write
        "matmul_dtype": str(dtype).removeprefix("torch."),
        "matmul_flops_per_s": 2 * n**3 / matmul_seconds,
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
    if model.config.tie_word_embeddings:  # lm_head is the embedding table (counted as one row above): all read
        total += text.vocab_size * text.hidden_size
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
    caches = None  # the prefill's, freed for the decode steps' own
    release_memory(device)
    # one sequence at 100 cached tokens, its graph captured for contexts up to the prefill's length
    batch1 = measure_decode_batch(model, device, batch=1, context=100, context_bound=tokens, repeats=20)
    decode_seconds = batch1["seconds"]
    floor = active_weight_bytes(model) / ceilings["copy_bandwidth_bytes_per_s"]
    release_memory(device)
    batch1_pdl = measure_decode_batch1_with_pdl(model, device, context_bound=tokens, floor=floor)
    batch1_pdl_unprefetched = measure_decode_batch1_with_pdl_without_prefetch(model, device, context_bound=tokens,
                                                                              floor=floor)
    batch1_unfused = measure_decode_batch1_without(NEWEST_DECODE_FUSIONS, model, device, context_bound=tokens,
                                                   floor=floor)
    batch, context = (DECODE_BATCH, DECODE_CONTEXT) if device.type == "cuda" else (4, 32)
    # e.g. out of memory: the batch-1 numbers above stand
    large_batch = auxiliary(lambda: measure_decode_batch(model, device, batch, context, context_bound=tokens))
    release_memory(device)
    return {
        "prefill_tokens": tokens,
        "prefill_seconds": prefill_seconds,
        "prefill_tokens_per_s": tokens / prefill_seconds,
        "prefill_mfu": flops / prefill_seconds / ceilings["matmul_flops_per_s"],
        "decode_batch1_seconds": decode_seconds,  # the step with its logits, as the floor counts lm_head
        "decode_batch1_graph_seconds": batch1["graph_seconds"],
        "decode_bandwidth_floor_seconds": floor,
        "decode_over_floor": decode_seconds / floor,
        "active_weight_bytes": active_weight_bytes(model),
        "cuda_graphs": batch1["cuda_graphs"],
        "decode_batch1_kernels": batch1["kernels"],  # where the step's time goes (kernel_breakdown)
        "decode_batch1_pdl": batch1_pdl,  # the same step with the other VLM_CATALOG_PDL setting
        "decode_batch1_pdl_without_prefetch": batch1_pdl_unprefetched,  # with PDL, no weight read before a wait
        "decode_batch1_unfused": batch1_unfused,  # the same step with NEWEST_DECODE_FUSIONS off
        "decode_large_batch": large_batch,  # a decode step of many sequences, and its kernels
    }


def measure_decode_batch1_with_pdl(model, device: torch.device, context_bound: int, floor: float) -> dict:
    """The batch-1 decode step captured with the other programmatic-dependent-launch setting
    than the run's (kernels/pdl.py; on when VLM_CATALOG_PDL is unset): its seconds, their ratio
    to the weight-bandwidth floor, and its kernels. An error is recorded, not raised."""
    if device.type != "cuda":
        return {"skipped": "programmatic dependent launch needs a CUDA device"}
    enabled = not pdl_requested()
    return measure_decode_batch1_variant(programmatic_dependent_launch(enabled), {"pdl": enabled}, model, device,
                                         context_bound, floor)


def measure_decode_batch1_with_pdl_without_prefetch(model, device: torch.device, context_bound: int,
                                                    floor: float) -> dict:
    """The batch-1 decode step with programmatic dependent launch and `pdl_weight_prefetch` off: its
    kernels read nothing before they wait for the grid before them (kernels/jit/l2_prefetch.py),
    so beside the PDL step it shows what asking for the weights early gave. As
    `measure_decode_batch1_with_pdl` records it."""
    if device.type != "cuda":
        return {"skipped": "programmatic dependent launch needs a CUDA device"}
    turned_off = sorted(kernels_off() | {"pdl_weight_prefetch"})

    @contextlib.contextmanager
    def setting():
        with programmatic_dependent_launch(True), environment_variable(KERNELS_OFF_ENV_VAR, ",".join(turned_off)):
            yield

    return measure_decode_batch1_variant(setting(), {"pdl": True, "kernels_off": turned_off}, model, device,
                                         context_bound, floor)


# The batch-1 decode step's newest launch savings (the fourteenth session, 2026-11-28, without a GPU):
# the post-attention norm with the router's logits and (its last program) the routing, the split
# decode merged by its last split, and the q/k/v and o projections by our kernel instead of cuBLAS.
# The roofline times the step with them off too, so a record shows what they gave.
NEWEST_DECODE_FUSIONS = ("add_rms_norm_router", "decode_merge_in_place", "skinny_linear")


def measure_decode_batch1_without(names: tuple[str, ...], model, device: torch.device, context_bound: int,
                                  floor: float) -> dict:
    """The batch-1 decode step with the ops or fast paths `names` also in VLM_CATALOG_KERNELS_OFF
    (kernels/dispatch.py): as `measure_decode_batch1_with_pdl` records it."""
    turned_off = sorted(kernels_off() | set(names))
    setting = environment_variable(KERNELS_OFF_ENV_VAR, ",".join(turned_off))
    return measure_decode_batch1_variant(setting, {"kernels_off": turned_off}, model, device, context_bound, floor)


def measure_decode_batch1_variant(setting, fields: dict, model, device: torch.device, context_bound: int,
                                  floor: float) -> dict:
    """The batch-1 decode step captured under `setting` (a context manager): `fields` and its
    seconds, their ratio to the floor and its kernels; an error is recorded, not raised."""
    try:
        with setting:
            step = measure_decode_batch(model, device, batch=1, context=100, context_bound=context_bound, repeats=20)
    except Exception as exc:  # noqa: BLE001 - e.g. a capture that refuses the launches: the run's step stands
        return {**fields, "error": error_text(exc)}
    finally:
        release_memory(device)
    return {**fields, "seconds": step["seconds"], "over_floor": step["seconds"] / floor, "kernels": step["kernels"]}


# A decode step as the engine's throughput runs take them (a batch of 256), with short contexts:
# with the bf16 model's 62 GB, 256 x 256 tokens of bf16 KV take 6.4 GB more (the engine's ~2k
# contexts would not fit beside it), so attention's share is smaller than in the engine.
DECODE_BATCH, DECODE_CONTEXT = 256, 256


def measure_decode_batch(model, device: torch.device, batch: int, context: int, context_bound: int,
                         repeats: int = 10) -> dict:
    """One decode step (a CUDA graph on CUDA, captured for contexts up to `context_bound`, as the
    engine's are for `max_model_len`) of `batch` sequences at `context` cached tokens each: its
    seconds, tokens per second and kernels (`kernel_breakdown`)."""
    from vlm_catalog.engine.cuda_graphs import DecodeGraphRunner

    text = model.config.text
    block_size = 16
    blocks_per_sequence = context // block_size + 1  # the context and the token written now
    caches = allocate_kv_caches(text.num_layers, batch * blocks_per_sequence, block_size, text.num_kv_heads,
                                text.head_dim, model.dtype, device)
    block_tables = torch.arange(batch * blocks_per_sequence, dtype=torch.int32, device=device).view(
        batch, blocks_per_sequence)  # [B, blocks]: each sequence its own blocks
    graphs = DecodeGraphRunner(model, caches, max_batch=batch,
                               max_blocks_per_sequence=-(-context_bound // block_size),
                               max_context_len=context_bound, buckets=[batch])
    graphs.capture()
    args = (
        torch.full((batch,), 7, device=device),  # input ids
        torch.full((3, batch), context, device=device),  # MRoPE positions
        block_tables[:, context // block_size].long() * block_size + context % block_size,  # the new token's slot
        block_tables,
        torch.full((batch,), context + 1, dtype=torch.int32, device=device),
    )

    def step():  # as the engine's decode step runs it: the graph, then every row's logits
        return model.compute_logits(graphs.run(*args)).float()

    seconds = timed(step, device, repeats=repeats)
    return {
        "batch": batch,
        "context": context,
        "seconds": seconds,  # the whole step, logits included
        # the graph alone (what the records before 2026-11-28's thirteenth session timed as the step,
        # against a floor that counts lm_head's weights)
        "graph_seconds": timed(lambda: graphs.run(*args), device, repeats=repeats),
        "tokens_per_s": batch / seconds,
        "cuda_graphs": bool(graphs.graphs),
        "kernels": kernel_breakdown(step, device),
    }


KERNEL_BREAKDOWN_ROWS = 25


def kernel_breakdown(step, device: torch.device, steps: int = 5) -> dict:
    """Where a step's time goes: torch.profiler over `steps` calls of `step` (after one untimed),
    the device's kernels (on a CPU, the ops' own CPU time) summed by name per step, largest
    first; `total_us_per_step` against the step's wall time shows the device's idle gaps. A
    profiler failure is recorded, not raised (the phase's other numbers stand)."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    try:
        step()
        synchronize(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        with profile(activities=activities) as profiler:
            for _ in range(steps):
                step()
            synchronize(device)
        rows = []
        for event in profiler.key_averages():
            own_us = event.self_device_time_total if on_cuda else event.self_cpu_time_total
            if own_us > 0:
                rows.append({"name": event.key[:160], "us_per_step": own_us / steps, "calls_per_step": event.count / steps})
    except Exception as exc:  # noqa: BLE001 - e.g. no CUPTI on this machine
        return {"error": error_text(exc)}
    rows.sort(key=lambda row: -row["us_per_step"])
    return {
        "steps": steps,
        "time": "device" if on_cuda else "cpu",
        "total_us_per_step": sum(row["us_per_step"] for row in rows),
        "kernels": rows[:KERNEL_BREAKDOWN_ROWS],
    }


def run_engine(engine: LLMEngine, conversations, params) -> tuple[float, float, dict[int, object]]:
    """Seconds to queue every conversation (prompt, tokens, image headers), seconds from then
    to finishing them all (image decoding included), and the final outputs by conversation index."""
    ids = {}
    start = time.perf_counter()
    for index, (messages, param) in enumerate(zip(conversations, params)):
        ids[engine.add_request(messages, param, f"bench-{index}-{time.monotonic_ns()}")] = index
    outputs = {}
    queued = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[ids[output.request_id]] = output
    return queued - start, time.perf_counter() - queued, outputs


CUDA_WARMUP_RECORDS = 32  # about two 16k-token prefill steps of benchmark records, and their decodes


def warm_up(engine: LLMEngine, conversations, params) -> dict:
    """An untimed run of other records before the timed one. A process's first steps pay one-time
    costs (Triton compiles each kernel config and specialization on first use, and the fused-MoE
    config differs per token bucket): on the H100 (2026-11-25) the first engine run of a process
    took 38.7 s, and the same work later in the process 30.2 s."""
    if not conversations:
        return {"records": 0, "seconds": 0.0}
    _, seconds, outputs = run_engine(engine, conversations, params)
    return {"records": len(outputs), "seconds": seconds}


ROUTING_RECORDS = 16  # records of the untimed routing pass after an engine phase's timed runs
ROUTING_TOKENS = 4


def routing_pass(engine: LLMEngine, model, conversations, sampling: Sampling) -> dict:
    """How spread the model's routing is over benchmark records (`bench/routing_stats.py`): an
    untimed run of the first `ROUTING_RECORDS` records for `ROUTING_TOKENS` tokens, sampled as
    the timed runs sample, with every router's choices counted. The MoE's cost follows its
    routing, so a record whose routing is far from uniform (`top_k_share` well above
    `uniform_top_k_share`) understates a trained model's. The pass runs its decode steps eagerly
    (the engine's decode graphs are set aside for it: a graph's replay runs no hooks)."""
    chosen = conversations[:ROUTING_RECORDS]
    params = [sampling.params(max_tokens=ROUTING_TOKENS, ignore_eos=True, output_kind=OFFLINE_OUTPUTS, seed=seed)
              for seed in range(len(chosen))]
    runner = engine.runner
    graphs, runner.graph_runner = runner.graph_runner, None
    try:
        with RoutingRecorder(model) as recorder:
            run_engine(engine, chosen, params)
    finally:
        runner.graph_runner = graphs
    return recorder.summary()


def engine_run_summary(engine: LLMEngine, conversations, params) -> tuple[dict, dict[int, object]]:
    before = dict(engine.stats.as_dict())
    with RunDiagnostics(engine.config.torch_device) as diagnostics:
        queue_seconds, seconds, outputs = run_engine(engine, conversations, params)
    stats = engine.stats.as_dict()
    delta = {key: stats[key] - before[key] for key in stats}
    summary = {
        "seconds": seconds,  # as in the first H100 run: from the queued requests to the last answer
        "queue_seconds": queue_seconds,
        "samples_per_s": len(outputs) / seconds,
        "generated_tokens": sum(len(o.token_ids) for o in outputs.values()),
        "prompt_tokens": delta["num_prompt_tokens_computed"],
        "prefill_tokens_per_s": delta["num_prompt_tokens_computed"] / max(delta["seconds_in_prefill_steps"], 1e-9),
        "decode_tokens_per_s": delta["num_output_tokens_computed"] / max(delta["seconds_in_decode_steps"], 1e-9),
        "model_steps": delta["num_steps"],
        "prefill_steps": delta["num_prefill_steps"],  # steps with a prefill chunk; the rest are decode steps
        # the host clock inside the text forward calls (launches, or a graph's replay): where it is
        # about the device time beside it, the device waited for the launches
        "host_forward_seconds": {"prefill_steps": delta["seconds_host_forward_prefill_steps"],
                                 "decode_steps": delta["seconds_host_forward_decode_steps"]},
        "jump_forward_tokens": delta["num_jump_forward_tokens"],
        "images_prefetched": delta["num_images_prefetched"],  # decoded while an earlier step ran
        "image_wait_seconds": delta["seconds_waiting_for_images"],  # steps waiting for image decodes
        "vision_encoder_seconds": delta["seconds_in_vision_encoder"],  # device time, within prefill steps
        # host time of the grammars (constrained requests): masks filled while the forward runs,
        # and grammars advanced over the sampled tokens after they are read
        "grammar_fill_seconds": delta["seconds_filling_grammar_masks"],
        "grammar_advance_seconds": delta["seconds_advancing_grammars"],
        "logit_masking_seconds": delta["seconds_masking_logits"],  # host time of applying the masks
        # how long constrained requests waited for their grammars (one compile thread) before scheduling
        "grammar_wait_seconds_mean": delta["seconds_awaiting_grammars"] / max(delta["num_grammars_attached"], 1),
        "errors": sum(o.finish_reason == "error" for o in outputs.values()),
        "device_seconds": device_time_split(delta, seconds),
        "host_seconds": host_time_split(delta),
        # what the run paid for besides its work: Triton variants first launched in it, Python's
        # collections, the caching allocator's cudaMallocs and retries (bench/run_diagnostics.py)
        "diagnostics": diagnostics.summary(),
    }
    return summary, outputs


def device_time_split(delta: dict, seconds: float) -> dict:
    """A run's `seconds` on the device, from the engine's CUDA-event timers (`EngineStats`): the
    vision tower, the text forward in steps with a prefill chunk and in decode steps, the rest of
    the steps (sampling, masks, uploads, waits inside a step) and the time between steps, when
    the device waits for the host to schedule the next one."""
    vision = delta["seconds_in_vision_encoder"]
    prefill = delta["seconds_device_forward_prefill_steps"]
    decode = delta["seconds_device_forward_decode_steps"]
    steps = delta["seconds_device_in_steps"]
    return {"vision_encoder": vision, "text_forward_prefill_steps": prefill, "text_forward_decode_steps": decode,
            "rest_of_steps": steps - vision - prefill - decode, "between_steps": seconds - steps}


def host_time_split(delta: dict) -> dict:
    """A run's host time in the engine's `step` calls (`EngineStats`): scheduling, the steps, the
    outputs built, and within the steps the wait for the previous step's sampled tokens (async
    scheduling: the host ahead, waiting for the device). `working` is the rest: where it is about
    the device's time in steps (`device_seconds`), the device waited for the host. A launch that
    waits for room in the device's launch queue counts as working here."""
    steps = delta["seconds_in_prefill_steps"] + delta["seconds_in_decode_steps"]
    scheduling, outputs = delta["seconds_scheduling"], delta["seconds_building_outputs"]
    waiting = {kind: delta[f"seconds_waiting_for_sampled_tokens_{kind}_steps"] for kind in ("prefill", "decode")}
    return {"scheduling": scheduling, "steps": steps, "outputs": outputs,
            "waiting_for_sampled_tokens": {f"{kind}_steps": seconds for kind, seconds in waiting.items()},
            "working": scheduling + steps + outputs - sum(waiting.values())}


def package_versions() -> dict[str, str | None]:
    """The versions a GPU record depends on (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            **{name: installed(name) for name in ("triton", "transformers", "xgrammar")}}


STEP_TOKENS = 16384  # max_num_batched_tokens of the engine phases (--max-num-batched-tokens)


def make_engine(checkpoint: Path, model, device: torch.device, kv_cache_dtype: str = "auto",
                async_scheduling: bool | None = None, max_num_batched_tokens: int = STEP_TOKENS) -> LLMEngine:
    config = EngineConfig(model=checkpoint, device=str(device), dtype="bfloat16" if device.type == "cuda" else "float32",
                          max_num_seqs=256, max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False,
                          scheduling_policy="shortest_prompt_first", max_model_len=32768, kv_cache_dtype=kv_cache_dtype,
                          async_scheduling=async_scheduling)
    return LLMEngine(config, prebuilt_model=model)


def memory_summary(engine: LLMEngine, device: torch.device) -> dict:
    stats = engine.cache_stats()
    graphs = engine.runner.graph_runner
    summary = {"kv_cache_tokens": stats["kv_capacity_tokens"], "memory_profile": stats["memory_profile"],
               "decode_cuda_graph_batches": sorted(graphs.graphs) if graphs is not None else [],
               "jump_forward": engine.jump_forward, "engine_warmup": stats["warmup"],
               # W8A8 dense GEMMs: per weight shape, cuBLAS (True) or the Triton kernel after a failed check
               "fp8_linear_cublas": fp8_linear_cublas.verdicts(),
               # MoE experts on torch's grouped GEMMs (VLM_CATALOG_MOE_GEMM=grouped_mm): per weight shape,
               # whether the first-call check against the Triton kernels admitted them
               "moe_grouped_gemm": grouped_gemm.verdicts(),
               # the vision MLP's GELU in cuBLASLt's epilogue: per weight shape, whether its check passed
               "gelu_gemm_epilogue": linear_gelu.verdicts()}
    if device.type == "cuda":
        summary["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    return summary


def measure_engine(checkpoint: Path, model, device: torch.device, records, output_tokens: int,
                   kv_cache_dtype: str = "auto", sampling: Sampling = QWEN3_VL_SAMPLING,
                   async_scheduling: bool | None = None, warmup_records=(),
                   max_num_batched_tokens: int = STEP_TOKENS, profiled: bool = False,
                   repeat_runs: int = 1) -> dict:
    """Offline throughput with `output_tokens` (150) output tokens per record (ignore_eos), drawn
    with `sampling`, after an untimed run of `warmup_records` (`warm_up`); `kv_cache_dtype="fp8"`:
    the same with an e4m3 KV cache (twice the tokens of bf16). `profiled`: the timed run under
    torch.profiler, and where its device time went (`profile`: `device_profile.profiled_call`);
    the profiler slows the host, so such a run's samples/s are not to report, its shares are.
    `repeat_runs` >= 2 (not profiled): the same run timed again that many times in all, each
    in `fixed_150_tokens_again` (`fixed_150_tokens` stays the first, as every record before)."""
    engine = make_engine(checkpoint, model, device, kv_cache_dtype, async_scheduling, max_num_batched_tokens)
    fixed = sampling.params(max_tokens=output_tokens, ignore_eos=True, output_kind=OFFLINE_OUTPUTS)
    warmup = warm_up(engine, [build_messages(record) for record in warmup_records], [fixed] * len(warmup_records))
    conversations = [build_messages(record) for record in records]
    results = {"warmup": warmup}

    def timed_run() -> dict:
        return engine_run_summary(engine, conversations, [fixed] * len(records))[0]

    if profiled:
        results["fixed_150_tokens"], results["profile"] = profiled_call(timed_run, device)
    else:
        results["fixed_150_tokens"] = timed_run()
        if repeat_runs >= 2:
            results["fixed_150_tokens_again"] = [timed_run() for _ in range(repeat_runs - 1)]
        results["routing"] = auxiliary(lambda: routing_pass(engine, model, conversations, sampling))
    results.update({"sampling": asdict(sampling), "async_scheduling": engine.async_scheduling, "repeat_runs": repeat_runs,
                    "max_num_batched_tokens": max_num_batched_tokens,
                    # the tuned tables (JSON) whose MoE tiles and decode launch settings it ran
                    "tuned_configs": list(engine.tuned_tables)})
    results.update(memory_summary(engine, device))
    engine.close()
    return results


def weight_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def weight_sizes(model) -> dict:
    decoder = model.language_model
    dense = sum(weight_bytes(getattr(module, name)) for module, name in decoder.dense_projections())
    return {"weight_bytes": weight_bytes(model), "expert_weight_bytes": sum(map(weight_bytes, decoder.moe_experts())),
            "dense_projection_bytes": dense}


def quantize_model(model, device: torch.device, fp8_activations: bool,
                   per_channel: bool) -> tuple[Fp8BlockQuantization, Fp8BlockQuantization]:
    """FP8 experts (quantized in place, one layer at a time, unless already FP8 in these blocks);
    `fp8_activations`: what `--quantization fp8_w8a8` loads, the dense projections in FP8 too
    (`Fp8Linear`) and every FP8 GEMM's input quantized; `per_channel` (with it):
    `--quantization fp8_w8a8_channel`'s one scale per row and per token, FP8 weights of other
    blocks requantized. Returns the experts' and the dense projections' blocks."""
    decoder = model.language_model
    text = model.config.text
    if per_channel:
        block = Fp8BlockQuantization(*per_channel_block(text.hidden_size, text.moe_intermediate_size))
        dense_block = Fp8BlockQuantization(*per_channel_block(*dense_input_widths(text)))
    else:
        block = fitting_block(text.moe_intermediate_size)
        dense_block = fitting_block(*dense_row_counts(text))
    for layer_experts in decoder.moe_experts():
        if layer_experts.fp8_block != block.block:
            # the layer's bf16 (or other-block FP8) experts are freed as quantize_ returns (reference
            # counts: no cycle holds them), and the caching allocator gives their memory to the next
            # layer's. A collection per layer cost 0.2-0.4 s of host time, 48 times at 30B-A3B.
            layer_experts.quantize_(block)
        layer_experts.fp8_activations = fp8_activations
    if fp8_activations and not isinstance(decoder.layers[0].self_attn.qkv_proj, Fp8Linear):
        decoder.use_fp8_linears(dense_block, quantize_present=True)
    elif fp8_activations:
        for module, name in decoder.dense_projections():
            if getattr(module, name).block != dense_block.block:
                getattr(module, name).requantize_(dense_block)
    release_memory(device)  # once, after every layer: what is left goes back to the device
    return block, dense_block


def measure_engine_fp8(checkpoint: Path, model, device: torch.device, records, output_tokens: int,
                       fp8_activations: bool = False, sampling: Sampling = QWEN3_VL_SAMPLING,
                       async_scheduling: bool | None = None, warmup_records=(), per_channel: bool = False,
                       fast_accumulation: bool = False, moe_gemm_choice: str | None = None,
                       max_num_batched_tokens: int = STEP_TOKENS, profiled: bool = False,
                       flash_varlen: str | None = None, tuned_table: Path | None = None,
                       repeat_runs: int = 1) -> dict:
    """`measure_engine` with FP8 experts (`quantize_model`, which says what `fp8_activations` and
    `per_channel` quantize) and an FP8 KV cache; `fast_accumulation`: under
    VLM_CATALOG_FP8_FAST_ACCUMULATION=1 (`kernels.dispatch.fp8_accumulation`); `moe_gemm_choice`:
    under VLM_CATALOG_MOE_GEMM=that (`kernels.moe.grouped_gemm.moe_gemm`; None: as set);
    `flash_varlen`: under VLM_CATALOG_FLASH_VARLEN=that (None: as set); `tuned_table`: under
    VLM_CATALOG_TUNED_CONFIGS=that (None: as set); `profiled`: as `measure_engine`'s."""
    before = weight_sizes(model)
    block, dense_block = quantize_model(model, device, fp8_activations, per_channel)
    gemms = grouped_gemm.moe_gemm(moe_gemm_choice) if moe_gemm_choice else contextlib.nullcontext()
    attention = (environment_variable(FLASH_VARLEN_ENV_VAR, flash_varlen) if flash_varlen
                 else contextlib.nullcontext())
    table = (environment_variable(TUNED_CONFIGS_ENV_VAR, str(tuned_table)) if tuned_table is not None
             else contextlib.nullcontext())
    with fp8_accumulation(fast_accumulation), gemms, attention, table:
        results = measure_engine(checkpoint, model, device, records, output_tokens, kv_cache_dtype="fp8",
                                 sampling=sampling, async_scheduling=async_scheduling, warmup_records=warmup_records,
                                 max_num_batched_tokens=max_num_batched_tokens, profiled=profiled,
                                 repeat_runs=repeat_runs)
        results["moe_gemm"] = grouped_gemm.moe_gemm_choice()
        results["flash_varlen"] = flash_varlen_module()
    results["fp8_fast_accumulation"] = fast_accumulation
    results["before"] = before
    results["after"] = weight_sizes(model)
    results["expert_block"] = list(block.block)  # (rows, columns) per scale: [1, K] is per-channel
    results["dense_block"] = list(dense_block.block) if fp8_activations else None
    return results


# engine_profile's records: every decode step still runs (150 per record), at half the benchmark's
# batch, with half its prefill
PROFILE_RECORDS = 128


def measure_constrained(checkpoint: Path, model, device: torch.device, records, output_tokens: int,
                        async_scheduling: bool | None = None, warmup_records=(),
                        max_num_batched_tokens: int = STEP_TOKENS, kv_cache_dtype: str = "auto",
                        repeat_runs: int = 1) -> dict:
    """The per-record schema (real stop) against unconstrained decoding of the same token counts,
    after an untimed constrained run of `warmup_records` (`warm_up`); `kv_cache_dtype`: the
    engine's cache (``fp8``: e4m3, as the FP8 engine phases).

    The unconstrained run gives each record `max_tokens` = what its constrained run generated
    (ignore_eos), so the two runs generate the same tokens and differ only in the grammar work.
    With `repeat_runs` >= 2 the constrained run is timed again after the unconstrained one
    (`constrained_again`): the first timed run of a process has been the slower on every GPU
    run so far, and the constrained run always came first (0.86x on the H100 of 2026-11-27,
    evening, its prefill forward 12.12 device seconds against 9.17 for the same kernels).
    """
    def schema_params(chosen) -> list[SamplingParams]:
        return [SamplingParams(max_tokens=output_tokens, json_schema=catalogue_schema(r.candidate_categories),
                               output_kind=OFFLINE_OUTPUTS)
                for r in chosen]

    engine = make_engine(checkpoint, model, device, kv_cache_dtype=kv_cache_dtype, async_scheduling=async_scheduling,
                         max_num_batched_tokens=max_num_batched_tokens)
    results = {"warmup": warm_up(engine, [build_messages(r) for r in warmup_records], schema_params(warmup_records))}
    conversations = [build_messages(record) for record in records]
    constrained = schema_params(records)
    compiled_before = engine.grammar_service.stats()
    results["constrained_real_stop"], outputs = engine_run_summary(engine, conversations, constrained)
    compiled_after = engine.grammar_service.stats()
    results["grammar_compilations"] = compiled_after.compilations - compiled_before.compilations  # cache misses
    results["grammar_compile_seconds"] = compiled_after.compile_seconds - compiled_before.compile_seconds
    matched = [SamplingParams(max_tokens=max(1, len(outputs[i].token_ids)), ignore_eos=True, output_kind=OFFLINE_OUTPUTS)
               for i in range(len(records))]
    results["unconstrained_same_tokens"], _ = engine_run_summary(engine, conversations, matched)
    unconstrained_rate = results["unconstrained_same_tokens"]["samples_per_s"]
    results["constrained_over_unconstrained"] = results["constrained_real_stop"]["samples_per_s"] / unconstrained_rate
    if repeat_runs >= 2:  # the same constrained run once more, now neither run is the process's first
        results["constrained_again"], again = engine_run_summary(engine, conversations, constrained)
        results["constrained_again_same_tokens"] = all(
            len(again[i].token_ids) == len(outputs[i].token_ids) for i in range(len(records)))
        results["constrained_again_over_unconstrained"] = (
            results["constrained_again"]["samples_per_s"] / unconstrained_rate)
        results["other_jump_forward"] = auxiliary(lambda: time_other_jump_forward(
            engine, conversations, constrained, outputs, unconstrained_rate))
    results["repeat_runs"] = repeat_runs
    results["async_scheduling"] = engine.async_scheduling
    results["max_num_batched_tokens"] = max_num_batched_tokens
    results.update(memory_summary(engine, device))
    engine.close()
    return results


def auxiliary(measure) -> dict:
    """`measure()`'s result, or {"error": ...} where it raised: a phase's auxiliary measurement
    (the routing pass, the other jump-forward setting) must not cost it the runs timed before."""
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001 - recorded in the phase
        traceback.print_exc()
        return {"error": error_text(exc)}


def error_text(exc: Exception) -> str:
    """How the record names a failure: the exception's type and message."""
    return f"{type(exc).__name__}: {exc}"


def time_other_jump_forward(engine: LLMEngine, conversations, constrained, outputs, unconstrained_rate: float) -> dict:
    """The constrained run once more with jump-forward set the other way from the engine's
    choice (`EngineConfig.jump_forward`: off where decode steps replay CUDA graphs, since a
    request with forced tokens makes its step an eager one; on elsewhere). Jump-forward appends
    the grammar's forced tokens without model steps, so it saves steps and may cost graphs: this
    times the trade on the device, with the same tokens (greedy and seeded answers do not change)."""
    chosen = engine.jump_forward
    engine.jump_forward = not chosen
    try:
        run, answers = engine_run_summary(engine, conversations, constrained)
    finally:
        engine.jump_forward = chosen
    return {"jump_forward": not chosen, "run": run,
            "same_tokens": all(answers[i].token_ids == outputs[i].token_ids for i in range(len(outputs))),
            "over_unconstrained": run["samples_per_s"] / unconstrained_rate}


def measure_constrained_fp8(checkpoint: Path, model, device: torch.device, records, output_tokens: int,
                            **options) -> dict:
    """`measure_constrained` on the per-channel W8A8 model (`quantize_model`, in place, as
    engine_w8a8_channel) with an FP8 KV cache."""
    block, dense_block = quantize_model(model, device, fp8_activations=True, per_channel=True)
    results = measure_constrained(checkpoint, model, device, records, output_tokens, kv_cache_dtype="fp8", **options)
    results["expert_block"], results["dense_block"] = list(block.block), list(dense_block.block)
    return results


# ------------------------------------------------------------------------ vision tower
def vision_flops(config, grids: list[tuple[int, int, int]]) -> float:
    """Multiply-add FLOPs (2 per MAC) of one vision-tower call on images of these patch grids."""
    hidden, inter, merge = config.hidden_size, config.intermediate_size, config.spatial_merge_size**2
    patches = sum(t * h * w for t, h, w in grids)
    segment_squares = sum(t * (h * w) ** 2 for t, h, w in grids)  # attention is per frame
    per_block = 2 * patches * hidden * (3 * hidden + hidden + 2 * inter) + 4 * segment_squares * hidden
    merged = patches // merge
    per_merger = 2 * merged * (hidden * merge) * (hidden * merge + config.out_hidden_size)
    embed = 2 * patches * config.patch_dim * hidden
    return embed + config.depth * per_block + (1 + len(config.deepstack_visual_indexes)) * per_merger


def measure_vision_encoder(checkpoint: Path, device: torch.device, records, ceilings: dict, images: int) -> dict:
    """The vision tower on `images` realistic images in one call (as the engine batches them)."""
    from vlm_catalog.preprocess.image import ImageProcessor

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tower = random_vision_tower(checkpoint, device, dtype)
    processor = ImageProcessor.from_pretrained(checkpoint)
    processed = [processor.process(record.image) for record in records[:images]]
    pixels = torch.cat([p.pixel_values for p in processed]).to(device)  # [N, patch_dim]
    grids = [tuple(p.grid_thw) for p in processed]
    grid_thw = torch.tensor(grids, device=device)

    def encode():
        with torch.inference_mode():
            tower(pixels, grid_thw)

    tower.grid_tables.clear()
    cold = timed(encode, device, repeats=1, warmup=0)  # first call: grid tables computed
    seconds = timed(encode, device, repeats=3, warmup=1)
    flops = vision_flops(tower.config, grids)
    return {
        "images": len(grids),
        "patches": int(pixels.shape[0]),
        "seconds": seconds,
        "seconds_first_call": cold,
        "flops": flops,
        "tflops_per_s": flops / seconds / 1e12,
        "mfu": flops / seconds / ceilings["matmul_flops_per_s"],
    }


# ------------------------------------------------------------------------ transformers
def measure_transformers(
    checkpoint: Path, device: torch.device, records, time_limit_s: float, cpu_batch: int, output_tokens: int
) -> dict:
    """transformers generate on `records`: a batch-1 probe, then batches sized from its memory.

    On CUDA the probe's peak activation bytes per token (prompt + generated) and the free
    memory give the batch size; a batch that still runs out of memory is halved and
    retried. Batches stop once `time_limit_s` has passed; the rate covers what finished.
    """
    from vlm_catalog.bench.baselines import TransformersPipeline

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_transformers_model(checkpoint, device, dtype)
    pipeline = TransformersPipeline(checkpoint, model=model)
    conversations = [build_messages(record) for record in records]
    prompt_tokens = [int(pipeline._inputs([c])["input_ids"].shape[1]) for c in conversations]
    results: dict = {"records_available": len(conversations)}

    def generate(batch: list) -> float:
        start = time.perf_counter()
        pipeline.generate(batch, output_tokens)
        synchronize(device)
        return time.perf_counter() - start

    if device.type == "cuda":
        torch.cuda.empty_cache()
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    probe_seconds = generate(conversations[:1])
    results["batch_1_probe"] = {"seconds": probe_seconds, "samples_per_s": 1 / probe_seconds}
    if device.type == "cuda":
        per_token = (torch.cuda.max_memory_allocated(device) - baseline) / (prompt_tokens[0] + output_tokens)
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(device)[0]
        longest = max(prompt_tokens) + output_tokens  # left padding: every row is as long as the longest
        batch = max(1, min(len(conversations), int(0.8 * free / (per_token * longest))))
        results["activation_bytes_per_token"] = per_token
    else:
        batch = max(1, min(cpu_batch, len(conversations)))
    results["batch_chosen"] = batch

    done, seconds, backoffs, first = 0, 0.0, 0, 1  # the probe's record is not counted again
    started = time.perf_counter()
    cursor = first
    while cursor < len(conversations) and time.perf_counter() - started < time_limit_s:
        chunk = conversations[cursor : cursor + batch]
        try:
            seconds += generate(chunk)
        except torch.OutOfMemoryError:
            gc.collect()
            torch.cuda.empty_cache()
            if batch == 1:
                results["error"] = "out of memory at batch 1"
                break
            batch, backoffs = max(1, batch // 2), backoffs + 1
            continue
        done += len(chunk)
        cursor += len(chunk)
    results["batched"] = {
        "batch": batch, "records": done, "seconds": seconds,
        "samples_per_s": done / seconds if seconds else None, "oom_backoffs": backoffs,
        "stopped_by_time_limit": cursor < len(conversations) and "error" not in results,
    }
    rates = [results["batch_1_probe"]["samples_per_s"], results["batched"]["samples_per_s"]]
    results["best_samples_per_s"] = max(rate for rate in rates if rate)
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


def kernel_benchmarks(device: torch.device, groups: tuple[str, ...] | None = None) -> dict:
    """The kernel table's `groups` (default all) at the model's shapes on CUDA; on CPU the
    interpreter smoke shapes."""
    bench_kernels = load_bench_kernels()
    shapes = bench_kernels.GPU_SHAPES if device.type == "cuda" else bench_kernels.TINY_SHAPES
    return bench_kernels.run_kernel_benchmarks(device, shapes, groups=groups)


# ------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=256)
    parser.add_argument("--warmup-records", type=int, default=None,
                        help="engine phases: an untimed run of this many other records first "
                             "(default 32 on CUDA, 0 on CPU, where nothing is compiled on first use)")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {', '.join(PHASES)}")
    parser.add_argument("--phase", choices=PHASES, help="run this one phase (overrides --phases)")
    parser.add_argument("--vision-images", type=int, default=32, help="images in the vision_encoder call")
    parser.add_argument("--hf-records", type=int, default=16, help="records the transformers phase may use")
    parser.add_argument("--hf-time-limit-s", type=float, default=180.0, help="transformers phase: stop batches after")
    parser.add_argument("--hf-cpu-batch", type=int, default=2, help="transformers batch size on CPU (no memory query)")
    parser.add_argument("--tiny", action="store_true", help="the default model's shapes (smoke test)")
    parser.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS, help="answer length cap (smoke tests: fewer)")
    parser.add_argument("--image-size", default="realistic", help="synthetic catalogue images: realistic or small")
    parser.add_argument("--engine-sampling", choices=("benchmark", "greedy"), default="benchmark",
                        help="the engine phases' sampling: the benchmark's (Qwen3-VL generation_config) or argmax")
    parser.add_argument("--async-scheduling", **ASYNC_SCHEDULING_OPTION,
                        help="engine phases: schedule each step before reading the previous step's tokens "
                             "(auto, the engine's default: on CUDA; the option alone: on)")
    parser.add_argument("--kernel-groups", type=lambda text: load_bench_kernels().parse_groups(text),
                        default=None, help="the kernels phase's groups of rows, comma-separated "
                                           "(default: all; bench_kernels.py --groups)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=STEP_TOKENS,
                        help="engine phases: tokens per step (prefill chunks and decodes together)")
    parser.add_argument("--profile-records", type=int, default=PROFILE_RECORDS,
                        help="engine_profile: the records of its profiled run (the first of --records)")
    parser.add_argument("--tuned-configs", type=Path, default=None,
                        help="engine_w8a8_channel_tuned: the tuned table (JSON) it runs with "
                             "(bench_kernels.py --tune-moe/--tune-decode --write-table)")
    parser.add_argument("--repeat-runs", type=int, default=1,
                        help="time each engine phase's run this many times in all (fixed_150_tokens_again), "
                             "and with 2 or more the constrained run again after the unconstrained one")
    parser.add_argument("--json", dest="json_out", type=Path)
    args = parser.parse_args(argv)
    engine_sampling = QWEN3_VL_SAMPLING if args.engine_sampling == "benchmark" else GREEDY
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here: run on a GPU machine, or --tiny --device cpu for a smoke test")
        return 0
    phases = [args.phase] if args.phase else [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases: {', '.join(sorted(unknown))}")
    if args.warmup_records is None:
        args.warmup_records = CUDA_WARMUP_RECORDS if device.type == "cuda" else 0
    if args.warmup_records < 0:
        parser.error(f"--warmup-records must be >= 0 (0: no warm-up), got {args.warmup_records}")
    if args.max_num_batched_tokens < 1:
        parser.error(f"--max-num-batched-tokens must be >= 1, got {args.max_num_batched_tokens}")
    if args.repeat_runs < 1:
        parser.error(f"--repeat-runs must be >= 1 (1: each run once), got {args.repeat_runs}")
    if "engine_w8a8_channel_tuned" in phases:
        if args.tuned_configs is None:
            parser.error("engine_w8a8_channel_tuned needs --tuned-configs PATH")
        try:
            load_table(args.tuned_configs)  # a missing or broken table fails here, not after the other phases
        except TunedTableError as error:
            parser.error(str(error))
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
    results["versions"] = package_versions()
    results["kernels_off"] = sorted(kernels_off())  # ops sent to their torch reference (VLM_CATALOG_KERNELS_OFF)
    results["pdl"] = pdl_requested()  # Triton kernels launched with programmatic dependent launch (VLM_CATALOG_PDL)
    results["kv_layout"] = kv_layout()  # the paged caches' memory layout (VLM_CATALOG_KV_LAYOUT)
    results["engine_output_kind"] = OFFLINE_OUTPUTS  # what the engine phases' requests ask for
    results["moe_gemm"] = moe_gemm_choice()  # the MoE experts' GEMMs at prefill sizes (VLM_CATALOG_MOE_GEMM)
    results["sdpa_backend"] = sdpa_backend()  # the long images' SDPA kernel order (VLM_CATALOG_SDPA_BACKEND)
    # the FlashAttention varlen kernel the attention ran (VLM_CATALOG_FLASH_VARLEN): torch's, or
    # FlashAttention 3's module where it was asked for and could run
    results["flash_varlen"] = flash_varlen_module()
    results.setdefault("phase_seconds", {})

    failed: list[str] = []

    def record(name: str, started: float, value) -> None:
        results[name] = value
        results["phase_seconds"][name] = time.perf_counter() - started
        print(f"{name}:", json.dumps(value, default=str), flush=True)
        if args.json_out:  # written after every phase, so a later timeout keeps the earlier ones
            args.json_out.write_text(json.dumps(results, indent=2, default=str) + "\n")

    def run_phase(name: str, measure) -> None:
        """Record `measure()`, or the error it raised: one phase's crash or out-of-memory on a
        GPU must not cost the phases after it (a device session is short)."""
        started = time.perf_counter()
        try:
            value = measure()
        except Exception as exc:  # noqa: BLE001 - reported in the JSON and the exit status
            traceback.print_exc()
            value = {"error": error_text(exc)}
            failed.append(name)
        else:
            if isinstance(value, dict) and value.get("errors"):  # the kernels phase: some rows failed
                failed.append(name)
        record(name, started, value)
        release_memory(device)  # this phase's engine and KV pool, before the next one profiles memory

    with tempfile.TemporaryDirectory() as scratch:
        shapes = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text()) if args.tiny else QWEN3_VL_30B_A3B
        if args.tiny:
            shapes = {key: shapes[key] for key in ("text_config", "vision_config", "tie_word_embeddings")}
        checkpoint = benchmark_checkpoint_dir(Path(scratch) / "checkpoint", shapes)
        records = []
        if NEEDS_RECORDS & set(phases):
            warmup_count = args.warmup_records if ENGINE_PHASES & set(phases) else 0
            count = max(args.records + warmup_count, args.vision_images if "vision_encoder" in phases else 0)
            catalogue = make_catalog(Path(scratch) / "catalogue", count, args.seed, image_size=args.image_size)
            records = list(load_catalogue(catalogue))
        engine_records = records[: args.records]
        warmup_records = records[args.records : args.records + args.warmup_records]  # others, untimed
        needs_ceilings = {"ceilings", "roofline", "vision_encoder"} & set(phases)
        if "ceilings" in phases or (needs_ceilings and "matmul_flops_per_s" not in results.get("ceilings", {})):
            run_phase("ceilings", lambda: measure_ceilings(device, dtype))
        if "kernels" in phases:
            run_phase("kernels", lambda: kernel_benchmarks(device, args.kernel_groups))
        if "vision_encoder" in phases:
            run_phase("vision_encoder", lambda: measure_vision_encoder(
                checkpoint, device, records, results["ceilings"], args.vision_images))
        model_phases = [phase for phase in PHASES if phase in NEEDS_MODEL and phase in phases]  # in PHASES order
        if model_phases:
            try:
                model = random_model(checkpoint, device, dtype)
            except Exception:  # noqa: BLE001 - every phase that needed it reports the error
                model = None
                failure = traceback.format_exc(limit=1).strip().splitlines()[-1]
                print(traceback.format_exc(), file=sys.stderr)
                for phase in model_phases:
                    failed.append(phase)
                    record(phase, time.perf_counter(), {"error": f"building the model failed: {failure}"})
            run_options = {"async_scheduling": args.async_scheduling, "warmup_records": warmup_records,
                           "max_num_batched_tokens": args.max_num_batched_tokens, "repeat_runs": args.repeat_runs}
            engine_options = {"sampling": engine_sampling, **run_options}  # constrained runs keep their own sampling
            measures = {
                "roofline": lambda: measure_roofline(model, device, results["ceilings"]),
                "engine": lambda: measure_engine(
                    checkpoint, model, device, engine_records, args.output_tokens, **engine_options),
                "engine_fp8_kv": lambda: measure_engine(
                    checkpoint, model, device, engine_records, args.output_tokens, kv_cache_dtype="fp8",
                    **engine_options),
                "constrained": lambda: measure_constrained(
                    checkpoint, model, device, engine_records, args.output_tokens, **run_options),
                # last (PHASES order): they quantize the model in place
                "engine_fp8": lambda: measure_engine_fp8(
                    checkpoint, model, device, engine_records, args.output_tokens, **engine_options),
                "engine_w8a8": lambda: measure_engine_fp8(
                    checkpoint, model, device, engine_records, args.output_tokens, fp8_activations=True,
                    **engine_options),
                "engine_w8a8_channel": lambda: measure_engine_fp8(
                    checkpoint, model, device, engine_records, args.output_tokens, fp8_activations=True,
                    per_channel=True, **engine_options),
                "engine_w8a8_channel_grouped_mm": lambda: measure_engine_fp8(
                    checkpoint, model, device, engine_records, args.output_tokens, fp8_activations=True,
                    per_channel=True, moe_gemm_choice="grouped_mm", **engine_options),
                "engine_w8a8_channel_fast": lambda: measure_engine_fp8(
                    checkpoint, model, device, engine_records, args.output_tokens, fp8_activations=True,
                    per_channel=True, fast_accumulation=True, **engine_options),
                "engine_w8a8_channel_fa3": lambda: measure_engine_fp8(
                    checkpoint, model, device, engine_records, args.output_tokens, fp8_activations=True,
                    per_channel=True, flash_varlen="fa3", **engine_options),
                "engine_w8a8_channel_fa2": lambda: measure_engine_fp8(
                    checkpoint, model, device, engine_records, args.output_tokens, fp8_activations=True,
                    per_channel=True, flash_varlen="torch", **engine_options),
                "engine_w8a8_channel_tuned": lambda: measure_engine_fp8(
                    checkpoint, model, device, engine_records, args.output_tokens, fp8_activations=True,
                    per_channel=True, tuned_table=args.tuned_configs, **engine_options),
                "constrained_w8a8_channel": lambda: measure_constrained_fp8(
                    checkpoint, model, device, engine_records, args.output_tokens, **run_options),
                "engine_profile": lambda: measure_engine_fp8(
                    checkpoint, model, device, engine_records[: args.profile_records], args.output_tokens,
                    fp8_activations=True, per_channel=True, profiled=True, **engine_options),
            }
            for phase in model_phases if model is not None else ():
                run_phase(phase, measures[phase])
            del model
            release_memory(device)
        if "transformers" in phases:
            run_phase("transformers", lambda: measure_transformers(
                checkpoint, device, records[: args.hf_records], args.hf_time_limit_s, args.hf_cpu_batch,
                args.output_tokens))
    engine_rate = results.get("engine", {}).get("fixed_150_tokens", {}).get("samples_per_s")
    hf_rate = results.get("transformers", {}).get("best_samples_per_s")
    if engine_rate and hf_rate:
        results["speedup_vs_transformers"] = engine_rate / hf_rate
        print(f"ours / transformers: {results['speedup_vs_transformers']:.1f}x")
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    if failed:
        print(f"failed phases: {', '.join(failed)} (their errors are in the results)")
    return 1 if failed else 0


if __name__ == "__main__":
    # What is alive now (the imported modules: torch, the model code, xgrammar) lives as long as the
    # process. Frozen, it is left out of every later collection, so that release_memory, called
    # after each phase, scans only what the phases made. (Only as a script: a test calling main in
    # its own process keeps its collector as it was.)
    gc.freeze()
    sys.exit(main())
