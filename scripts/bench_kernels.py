#!/usr/bin/env python3
"""Benchmark the Triton kernels against their torch baselines (GPU only).

Shapes are Qwen3-VL-30B-A3B's (hidden 2048, 32 query heads, 4 KV heads, head_dim
128, 128 experts, top-8, expert intermediate 768; vision: 16 heads of 72). Each
row times the Triton op and its baseline on fresh random data, and reports the
speed-up and the achieved memory bandwidth or FLOP rate. Times are the device's
alone, in CUDA graphs with L2 flushed between calls (`make_graph_timer`); an op that
cannot be captured is timed by `triton.testing.do_bench` instead, and its row says
so. Beside each row, `host_ms` is the host's time per call of ours when calls are
launched back to back: what an eager step pays to launch it. (do_bench alone
measures the host's launches wherever they outlast the kernel.)

Targets: fused MoE >= 3x the per-expert loop at 256 tokens; paged decode
attention at or above PyTorch SDPA on pre-gathered (contiguous) K/V.

    python scripts/bench_kernels.py                  # table
    python scripts/bench_kernels.py --json out.json  # + numbers as JSON
    python scripts/bench_kernels.py --groups attention,moe  # only these groups of rows
                                                     # (elementwise, attention, moe, dense_fp8)
    python scripts/bench_kernels.py --tune-moe [--fp8 [--w8a8] [--per-channel]] [--buckets 1 256] [--compile-workers 8]
                                                     # best MoE block sizes per token bucket
    python scripts/bench_kernels.py --tune-decode [--fp8] [--buckets 1 256]
                                                     # best decode attention launch per batch bucket
    python scripts/bench_kernels.py --interpret      # CPU smoke run: tiny shapes, interpreter

Other scripts can call `run_kernel_benchmarks(device[, groups=...])` (returns the JSON dict)
`tune_moe(device)` and `tune_decode(device)`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


@dataclass(frozen=True)
class Shapes:
    hidden: int = 2048
    num_q_heads: int = 32
    num_kv_heads: int = 4
    head_dim: int = 128
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    num_experts: int = 128
    top_k: int = 8
    moe_intermediate: int = 768
    vision_heads: int = 16
    vision_head_dim: int = 72
    vision_intermediate: int = 4304
    block_size: int = 16
    num_tokens: int = 4096  # prefill-sized batch for the elementwise ops
    moe_token_counts: tuple[int, ...] = (1, 16, 256, 1024, 4096, 16384)  # 16384: the engine's prefill steps
    grouped_gemm_min_tokens: int = 256  # MoE rows on torch's grouped GEMMs from here (the crossover)
    moe_target_tokens: int = 256
    # calls of up to this many tokens run inside the engine's decode CUDA graphs (the default
    # EngineConfig.cuda_graph_max_batch): `--tune-moe` times such buckets in graphs
    # (timer_for_tokens), larger ones host-launched (quicker, and as accurate for long calls)
    graph_max_tokens: int = 256
    decode_cases: tuple[tuple[int, int], ...] = (
        (1, 27000),
        (32, 2048),
        (128, 1024),
    )  # (batch, context)
    # --tune-decode: the engine's decode conditions, a benchmark-sized context under the bound the
    # decode CUDA graphs are captured with (max_model_len), per batch bucket
    decode_tuning_context: int = 2048
    decode_graph_bound: int = 32768
    decode_tuning_batches: tuple[int, ...] = (1, 8, 32, 64, 128, 256)
    # the engine's full decode batch at a benchmark-sized context: the decode variants' rows
    # (`_decode_variant_rows`) time it beside the decode cases above
    full_decode_case: tuple[int, int] = (256, 2048)
    prefill_cases: tuple[tuple[int, int, int], ...] = (
        (4, 2048, 0),
        (1, 2048, 6144),
    )  # (seqs, new, prefix)
    fresh_prefill_cases: tuple[tuple[int, int], ...] = (
        (16, 256),
        (8, 512),
        (4, 1024),
        (2, 2048),
        (1, 8192),
    )  # (prompts, tokens each): the crossover between Triton and SDPA sets SDPA_MIN_PREFILL_LEN
    vision_cases: tuple[tuple[int, int], ...] = (
        (1, 15625),
        (4, 4096),
        (8, 1024),
        (16, 576),
        (32, 256),
    )  # (images, patches each): the crossover between Triton and SDPA sets SDPA_MIN_SEGMENT_LEN


GPU_SHAPES = Shapes()
TINY_SHAPES = Shapes(  # --interpret smoke run: every code path, seconds on a CPU
    hidden=64,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=32,
    mrope_section=(6, 5, 5),
    num_experts=8,
    top_k=2,
    moe_intermediate=32,
    vision_heads=2,
    vision_head_dim=24,
    vision_intermediate=40,
    block_size=4,
    num_tokens=16,
    moe_token_counts=(4, 16),
    grouped_gemm_min_tokens=16,
    moe_target_tokens=16,
    graph_max_tokens=4,  # --tune-moe takes both timers: T=4 as in a graph, T=16 host-launched
    decode_cases=((2, 40),),
    decode_tuning_context=40,
    decode_graph_bound=64,
    decode_tuning_batches=(1, 2),
    full_decode_case=(3, 40),
    prefill_cases=((2, 16, 8),),
    fresh_prefill_cases=((2, 24),),
    vision_cases=((2, 20),),
)


@dataclass
class Row:
    name: str
    shape: str
    triton_ms: float
    baseline: str
    baseline_ms: float
    rate: str  # achieved bandwidth or FLOP rate of the Triton op
    target_speedup: float | None = None  # the speed-up this row must reach, if any
    note: str = ""
    host_ms: float | None = None  # the host's time per call of ours, launched back to back (Timing)

    def __post_init__(self) -> None:
        """Takes the host time and the way each was timed from `Timing`s (a GPU's timer), which
        become plain numbers: a note names each timing that is not device time in a graph."""
        if self.host_ms is None:
            self.host_ms = getattr(self.triton_ms, "host_ms", None)
        notes = (timing_note("ours", self.triton_ms), timing_note("baseline", self.baseline_ms))
        self.note = "; ".join(part for part in (self.note, *notes) if part)
        self.triton_ms, self.baseline_ms = float(self.triton_ms), float(self.baseline_ms)

    @property
    def speedup(self) -> float:
        return self.baseline_ms / self.triton_ms

    @property
    def meets_target(self) -> bool | None:
        return None if self.target_speedup is None else self.speedup >= self.target_speedup


# --------------------------------------------------------------------------- timing
def make_timer(device) -> Callable[[Callable[[], object]], float]:
    """Milliseconds per call: do_bench's median on CUDA; on CPU, the wall clock of one call after
    a warm-up. CPU runs are smoke runs under the Triton interpreter (--interpret, and bench_gpu's
    kernels phase without a GPU), whose times say nothing about a GPU: one timed call checks that
    every row runs, at half the calls a median of three took (the interpreter is most of the
    suite's time)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")

    def wall_clock(fn) -> float:
        fn()  # warm-up (compiles / rewrites the kernel)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return wall_clock


GRAPH_CALLS = 20  # calls per captured graph at most: the replay's own launch is spread over them
GRAPH_TARGET_MS = 2.0  # ... and as many as make about this much device time (a long op takes one)
HOST_CALLS = 50  # calls launched back to back to time the host's share of one, at most
HOST_TARGET_MS = 20.0  # ... and as many as make about this much device time (at least 3)
FLUSH_BYTES = 256 << 20  # several times an H100's 50 MB L2


class Timing(float):
    """Milliseconds per call, and how they were measured: `in_graph` (the device's time alone, in a
    CUDA graph) or not (do_bench's host-launched calls, where capturing failed), and `host_ms`, the
    host's time per call when calls are launched back to back without waiting (`host_ms_per_call`;
    None where not measured). A `Row` takes both into its `host_ms` and its note."""

    in_graph: bool
    host_ms: float | None

    def __new__(cls, ms: float, *, in_graph: bool = True, host_ms: float | None = None) -> Timing:
        # (defaults: pickle and copy rebuild it from the number, then restore the attributes)
        timing = super().__new__(cls, ms)
        timing.in_graph, timing.host_ms = in_graph, host_ms
        return timing


def make_graph_timer(device, measure_host: bool = True) -> Callable[[Callable[[], object]], float]:
    """Every row's timer on a GPU: milliseconds per call of the device alone, L2 cold, in a CUDA
    graph (`graph_ms_per_call`), with the host's time per call beside it (`host_ms_per_call`).

    do_bench launches each call from the host between its events, so a call whose host work
    (argument checks, Triton's launcher, the allocations) outlasts its device time measures the
    host. On the H100 of 2026-11-27 that was most small rows: fused_add_rms_norm at T=4096 took
    0.070 ms against 0.028 on 2026-11-25, its torch reference with it, and large kernels read the
    same both days (docs/benchmarks.md). Timed apart, the two numbers say what each costs where:
    a decode graph replays the device's part only, and an eager step keeps the device busy as
    long as the host launches faster than the device runs. The tuners, which compare device
    times only, skip the host's (`measure_host=False`). On CPU: `make_timer`'s wall clock."""
    if device.type != "cuda":
        return make_timer(device)
    import torch

    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)
    return GraphTimer(partial(graph_ms_per_call, capture=capture_cuda_graph, replay_ms=cuda_replay_ms,
                              flush=flush.zero_), make_timer(device),
                      host=partial(host_ms_per_call, synchronize=torch.cuda.synchronize) if measure_host else None)


class GraphTimer:
    """`timed(fn)` in CUDA graphs, or `fallback(fn)` (do_bench) where capturing fails, as a
    `Timing` with `host(fn, calls=n)`'s host time (when given; n from HOST_CALLS down to 3 for
    long calls, whose launches hardly matter); the failure is printed once per kind and
    `fell_back` says whether the last call took the fallback."""

    def __init__(self, timed, fallback, host=None) -> None:
        self.timed, self.fallback, self.host = timed, fallback, host
        self.fell_back = False
        self._reported: set[str] = set()

    def __call__(self, fn) -> Timing:
        try:
            ms = self.timed(fn)
        except Exception as error:  # noqa: BLE001 - e.g. an op that cannot be captured: time it as do_bench does
            kind = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160] if str(error).strip() else ''}"
            if kind not in self._reported:
                self._reported.add(kind)
                print(f"  graph timing failed, timing host-launched calls instead ({kind})", file=sys.stderr)
            self.fell_back = True
            ms = self.fallback(fn)
        else:
            self.fell_back = False
        host_ms = None
        if self.host is not None:
            host_ms = self.host(fn, calls=max(3, min(HOST_CALLS, math.ceil(HOST_TARGET_MS / max(ms, 1e-3)))))
        return Timing(ms, in_graph=not self.fell_back, host_ms=host_ms)


def timer_for_tokens(num_tokens: int, shapes: Shapes, timer, graph_timer):
    """The MoE tuner's timer for a bucket of `num_tokens` tokens: `graph_timer` up to
    `shapes.graph_max_tokens` (the decode graphs' sizes), else `timer` (do_bench), which is as
    accurate for calls far longer than their launch and much quicker over ~100 candidates. At
    decode sizes do_bench times the host's launches: on the H100 of 2026-11-27 every fused-MoE
    candidate at T=1 took about 0.24 ms that way, ten times what its weights take to read, so
    the tuner's pick there was noise."""
    return graph_timer if num_tokens <= shapes.graph_max_tokens else timer


def graph_note(timer) -> str:
    """How `timer`'s last timing ran (the tuner prints it)."""
    if not isinstance(timer, GraphTimer):
        return ""
    return "host-launched (graph capture failed)" if timer.fell_back else "device time in a CUDA graph, L2 cold"


def timing_note(whose: str, ms: float) -> str:
    """A row's note for one of its timings that is not the table's default (device time in a
    graph): "<whose>: host-launched (graph capture failed)"; "" otherwise, and for a plain
    number (the CPU's wall clock)."""
    if isinstance(ms, Timing) and not ms.in_graph:
        return f"{whose}: host-launched (graph capture failed)"
    return ""


def host_ms_per_call(fn, *, synchronize, calls: int = HOST_CALLS, clock=time.perf_counter) -> float:
    """The host's milliseconds per call of `fn` when `calls` of them are launched back to back:
    the device is not waited for in between (only before and after), so this is the argument
    checks, the allocations and the launches, as an eager step pays them. Far fewer launches than
    a CUDA stream queues, so none waits for a free slot."""
    fn()
    synchronize()
    start = clock()
    for _ in range(calls):
        fn()
    elapsed = clock() - start
    synchronize()
    return elapsed * 1e3 / calls


def graph_ms_per_call(fn, *, capture, replay_ms, flush, max_calls: int = GRAPH_CALLS,
                      target_ms: float = GRAPH_TARGET_MS) -> float:
    """`fn`'s time per call: a graph of n x (flush, fn) against one of n x flush, each captured by
    `capture(body)` and timed by `replay_ms(graph)`. n: enough calls for about `target_ms` of
    device time by a one-call graph's estimate, from 1 to `max_calls`."""
    fn()  # compiles (and autotunes) outside the capture
    estimate = replay_ms(capture(fn))
    calls = max(1, min(max_calls, math.ceil(target_ms / max(estimate, 1e-6))))

    def flushed_calls() -> None:
        for _ in range(calls):
            flush()
            fn()

    def flushes() -> None:
        for _ in range(calls):
            flush()

    with_fn, flush_only = capture(flushed_calls), capture(flushes)
    return max(replay_ms(with_fn) - replay_ms(flush_only), 0.0) / calls


def capture_cuda_graph(body):
    """`body`'s launches captured in a CUDA graph (after a run on a side stream, as torch asks).

    A body that waits on the device (`.item()`, a boolean-mask index, `.tolist()`) cannot be
    captured, and a failed capture leaves the process broken: torch's capture ends with an error
    before it gives back the stream and the default generator's capture mode, so every later
    `torch.randn` on the device raised "Offset increment outside graph capture" (the kernels
    phase on the H200 of 2026-11-27 lost every row to it). So the side-stream run happens under
    torch's sync debug mode "error": such a body raises `HostSyncError` before any capture
    starts. A capture that fails anyway gives the stream and the generator back before its error
    goes on (`_recover_from_failed_capture`)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        refuse_host_syncs(body)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    caller_stream = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph):
            body()
    except Exception:
        _recover_from_failed_capture(caller_stream)
        raise
    return graph


class HostSyncError(RuntimeError):
    """The timed call waits on the device from the host, so a CUDA graph cannot hold it."""


def refuse_host_syncs(body) -> None:
    """Runs `body` once with torch's sync debug mode at "error" (restored after): a call that
    synchronizes raises `HostSyncError` instead of starting a capture that must fail."""
    import torch

    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        body()
    except RuntimeError as error:
        if "synchronizing" not in str(error):
            raise
        raise HostSyncError(f"it synchronizes with the device ({str(error).strip().splitlines()[0][:120]})") from error
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _recover_from_failed_capture(caller_stream) -> None:
    """After `torch.cuda.graph` raised: the caller's stream current again, and the default CUDA
    generator on a fresh state (same seed) outside capture mode, so the process can go on."""
    import torch

    torch.cuda.set_stream(caller_stream)
    device = caller_stream.device
    generator = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    fresh = torch.Generator(device=device)
    fresh.manual_seed(generator.initial_seed())
    generator.graphsafe_set_state(fresh)


def cuda_replay_ms(graph, replays: int = 10) -> float:
    """Median milliseconds of a graph's replay, timed by events."""
    import torch

    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gigabytes_per_second(num_bytes: float, ms: float) -> str:
    return f"{num_bytes / ms / 1e6:,.0f} GB/s"


def teraflops(flops: float, ms: float) -> str:
    return f"{flops / ms / 1e9:,.1f} TFLOP/s"


# --------------------------------------------------------------------------- helpers
def _paged_cache(batch: int, context: int, shapes: Shapes, dtype, device, lengths: list[int] | None = None):
    """Caches holding `batch` sequences of `context` tokens (or of `lengths`) in shuffled blocks."""
    import torch

    lengths = lengths or [context] * batch
    blocks_per_seq = -(-max(lengths) // shapes.block_size)
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, shapes.block_size, shapes.num_kv_heads, shapes.head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    block_tables = (
        torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).to(torch.int32)
    )
    context_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    return k_cache, v_cache, block_tables, context_lens


def spread_lengths(batch: int, context: int) -> list[int]:
    """`batch` context lengths evenly from 0.4 to 1.6 x `context` (mean `context`), in a fixed
    shuffled order. A decode batch's prompts differ in length: with one split per sequence the
    longest ones are the launch's tail, which equal lengths would hide from the tuner."""
    import random

    if batch == 1:
        return [context]
    lengths = [round(context * (0.4 + 1.2 * i / (batch - 1))) for i in range(batch)]
    random.Random(0).shuffle(lengths)
    return lengths


def head_major_pages(cache):
    """`cache` [blocks, block, Hkv, D] copied into a head-major pool of the same shape (each page
    [Hkv, block, D] in memory: `kernels.kv_cache`, VLM_CATALOG_KV_LAYOUT=head_major)."""
    from kernels.kv_cache import zeros_paged_cache

    return zeros_paged_cache(*cache.shape, cache.dtype, cache.device, "head_major").copy_(cache)


def _gathered(cache, block_tables, context: int):
    """[N, bs, Hkv, D] cache -> dense [B, Hkv, L, D] for SDPA."""
    dense = cache[block_tables.long()].flatten(1, 2)[:, :context]  # [B, L, Hkv, D]
    return dense.transpose(1, 2).contiguous()  # [B, Hkv, L, D]


def _moe_inputs(num_tokens: int, shapes: Shapes, dtype, device):
    import torch

    from kernels.moe.routing import route_topk_reference

    hidden = torch.randn(num_tokens, shapes.hidden, dtype=dtype, device=device)
    w13 = (
        torch.randn(
            shapes.num_experts,
            2 * shapes.moe_intermediate,
            shapes.hidden,
            dtype=dtype,
            device=device,
        )
        * shapes.hidden**-0.5
    )
    w2 = (
        torch.randn(
            shapes.num_experts, shapes.hidden, shapes.moe_intermediate, dtype=dtype, device=device
        )
        * shapes.moe_intermediate**-0.5
    )
    logits = torch.randn(num_tokens, shapes.num_experts, device=device)
    weights, ids = route_topk_reference(logits, shapes.top_k, True)
    return hidden, w13, w2, weights, ids


def _moe_cost(num_tokens: int, shapes: Shapes, element_bytes: int) -> tuple[float, float]:
    """(FLOPs, bytes of expert weights read) of one fused MoE call."""
    pairs = num_tokens * shapes.top_k
    flops = (
        2 * pairs * 3 * shapes.hidden * shapes.moe_intermediate
    )  # gate+up (2I x H) and down (H x I)
    experts_touched = min(shapes.num_experts, pairs)
    weight_bytes = experts_touched * 3 * shapes.hidden * shapes.moe_intermediate * element_bytes
    return flops, weight_bytes


# --------------------------------------------------------------------------- benchmarks
def bench_elementwise(shapes: Shapes, dtype, device, timer) -> list[Row]:
    import torch

    from kernels.activation import silu_and_mul_reference, silu_and_mul_triton
    from kernels.fp8_input import Fp8InputLayout, quantize_fp8_input
    from kernels.kv_cache import reshape_and_cache_reference, reshape_and_cache_triton
    from kernels.linear_gelu import epilogue_wanted, linear_gelu_tanh, linear_gelu_tanh_reference
    from kernels.moe.routing import route_topk_reference, route_topk_triton
    from kernels.rms_norm import (
        fused_add_rms_norm_reference,
        fused_add_rms_norm_triton,
        fused_sum_add_rms_norm_triton,
        rms_norm_reference,
        rms_norm_triton,
    )
    from kernels.rotary import qk_norm_mrope_reference, qk_norm_mrope_triton
    from kernels.vision_rotary import vision_rotary_reference, vision_rotary_triton

    rows = []
    tokens, hidden, element = shapes.num_tokens, shapes.hidden, torch.finfo(dtype).bits // 8
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, dtype=dtype, device=device)
    ms = timer(lambda: rms_norm_triton(x, weight, 1e-6))
    rows.append(
        Row(
            "rms_norm",
            f"T={tokens} H={hidden}",
            ms,
            "torch reference",
            timer(lambda: rms_norm_reference(x, weight, 1e-6)),
            gigabytes_per_second(2 * x.numel() * element, ms),
        )
    )
    ms = timer(lambda: fused_add_rms_norm_triton(x, residual, weight, 1e-6))
    rows.append(
        Row(
            "fused_add_rms_norm",
            f"T={tokens} H={hidden}",
            ms,
            "torch reference",
            timer(lambda: fused_add_rms_norm_reference(x, residual, weight, 1e-6)),
            gigabytes_per_second(4 * x.numel() * element, ms),
        )
    )
    for num_tokens in (1, tokens):  # a MoE layer's 8 expert terms: decode at batch 1, and prefill
        terms = torch.randn(num_tokens, 8, hidden, dtype=dtype, device=device)
        part = residual[:num_tokens]
        baseline_ms = timer(lambda terms=terms, part=part: fused_add_rms_norm_triton(terms.sum(1), part, weight, 1e-6))
        ms = timer(partial(fused_sum_add_rms_norm_triton, terms, part, weight, 1e-6))
        rows.append(
            Row(
                "fused_sum_add_rms_norm",
                f"T={num_tokens} K=8 H={hidden}",
                ms,
                "torch sum, then fused_add_rms_norm (Triton)",
                baseline_ms,
                gigabytes_per_second((8 + 3) * num_tokens * hidden * element, ms),
                target_speedup=1.0,
            )
        )

    # the norm before a W8A8 GEMM writing its FP8 input (kernels/fp8_input.py), against the norm's
    # 16-bit output quantized by its own launch: q/k/v on cuBLAS (per-channel: one scale per token,
    # rows padded to 4), after a MoE layer's 8 terms, as a prefill step runs it
    if dtype in (torch.bfloat16, torch.float16):
        terms = torch.randn(tokens, 8, hidden, dtype=dtype, device=device)
        layout = Fp8InputLayout(group=hidden, row_multiple=4)
        ms = timer(lambda: fused_sum_add_rms_norm_triton(terms, residual, weight, 1e-6, layout))
        rows.append(
            Row(
                "fused_sum_add_rms_norm[FP8 out]",
                f"T={tokens} K=8 H={hidden}, one scale per token",
                ms,
                "the same norm, then quantize_fp8_input (its own launch)",
                timer(lambda: quantize_fp8_input(fused_sum_add_rms_norm_triton(terms, residual, weight, 1e-6)[0],
                                                 layout)),
                gigabytes_per_second((8 + 2) * tokens * hidden * element + tokens * hidden, ms),
                target_speedup=1.0,
            )
        )

    q = torch.randn(tokens, shapes.num_q_heads, shapes.head_dim, dtype=dtype, device=device)
    k = torch.randn(tokens, shapes.num_kv_heads, shapes.head_dim, dtype=dtype, device=device)
    q_weight = torch.randn(shapes.head_dim, dtype=dtype, device=device)
    k_weight = torch.randn(shapes.head_dim, dtype=dtype, device=device)
    positions = torch.randint(0, 27000, (3, tokens), device=device)
    inv_freq = 1.0 / (
        5e6 ** (torch.arange(0, shapes.head_dim, 2, device=device).float() / shapes.head_dim)
    )
    rope_args = (q, k, q_weight, k_weight, positions, inv_freq, shapes.mrope_section, 1e-6)
    ms = timer(lambda: qk_norm_mrope_triton(*rope_args))
    rows.append(
        Row(
            "qk_norm_mrope",
            f"T={tokens} Hq={shapes.num_q_heads} Hkv={shapes.num_kv_heads}",
            ms,
            "torch reference",
            timer(lambda: qk_norm_mrope_reference(*rope_args)),
            gigabytes_per_second(2 * (q.numel() + k.numel()) * element, ms),
        )
    )

    patches, vision_heads, vision_dim = 4 * tokens, shapes.vision_heads, shapes.vision_head_dim
    qkv = torch.randn(patches, 3, vision_heads, vision_dim, dtype=dtype, device=device)
    vision_q, vision_k, _ = qkv.unbind(dim=1)  # strided views, as the vision tower passes them
    angles = torch.rand(patches, vision_dim, device=device) * 50  # [N, D] float32
    vision_args = (vision_q, vision_k, angles.cos(), angles.sin())
    ms = timer(lambda: vision_rotary_triton(*vision_args))
    rows.append(
        Row(
            "vision_rotary",
            f"N={patches} H={vision_heads} D={vision_dim}",
            ms,
            "torch reference",
            timer(lambda: vision_rotary_reference(*vision_args)),
            gigabytes_per_second(4 * vision_q.numel() * element + 2 * angles.numel() * 4, ms),
        )
    )

    # the vision MLP's first GEMM with its bias and tanh GELU: in cuBLASLt's epilogue (ours, on
    # CUDA) against F.linear then F.gelu; a GEMM's FLOP rate
    vision_hidden = vision_heads * vision_dim
    fc1_in = torch.randn(patches, vision_hidden, dtype=dtype, device=device)
    fc1_weight = torch.randn(shapes.vision_intermediate, vision_hidden, dtype=dtype, device=device) * vision_hidden**-0.5
    fc1_bias = torch.randn(shapes.vision_intermediate, dtype=dtype, device=device)
    linear_gelu_tanh(fc1_in, fc1_weight, fc1_bias)  # its first call checks the epilogue (a host read): not in a graph
    ms = timer(lambda: linear_gelu_tanh(fc1_in, fc1_weight, fc1_bias))
    rows.append(
        Row(
            "linear_gelu_tanh",
            f"N={patches} {vision_hidden}->{shapes.vision_intermediate}",
            ms,
            "F.linear, then F.gelu",
            timer(lambda: linear_gelu_tanh_reference(fc1_in, fc1_weight, fc1_bias)),
            teraflops(2 * patches * vision_hidden * shapes.vision_intermediate, ms),
            note="" if epilogue_wanted(fc1_in, fc1_weight, fc1_bias) else "the epilogue does not run here: both are the reference",
        )
    )

    gate_up = torch.randn(tokens, 2 * shapes.moe_intermediate, dtype=dtype, device=device)
    ms = timer(lambda: silu_and_mul_triton(gate_up))
    rows.append(
        Row(
            "silu_and_mul",
            f"T={tokens} I={shapes.moe_intermediate}",
            ms,
            "torch reference",
            timer(lambda: silu_and_mul_reference(gate_up)),
            gigabytes_per_second(1.5 * gate_up.numel() * element, ms),
        )
    )

    k_cache, v_cache, _, _ = _paged_cache(1, 2 * tokens, shapes, dtype, device)
    slots = torch.randperm(k_cache.shape[0] * shapes.block_size, device=device)[:tokens]
    new_k = torch.randn(tokens, shapes.num_kv_heads, shapes.head_dim, dtype=dtype, device=device)
    new_v = torch.randn_like(new_k)
    ms = timer(lambda: reshape_and_cache_triton(new_k, new_v, k_cache, v_cache, slots))
    rows.append(
        Row(
            "reshape_and_cache",
            f"T={tokens} Hkv={shapes.num_kv_heads}",
            ms,
            "torch reference",
            timer(lambda: reshape_and_cache_reference(new_k, new_v, k_cache, v_cache, slots)),
            gigabytes_per_second(4 * new_k.numel() * element, ms),
        )
    )

    logits = torch.randn(tokens, shapes.num_experts, dtype=dtype, device=device)
    ms = timer(lambda: route_topk_triton(logits, shapes.top_k, True))
    rows.append(
        Row(
            "route_topk",
            f"T={tokens} E={shapes.num_experts} K={shapes.top_k}",
            ms,
            "torch reference",
            timer(lambda: route_topk_reference(logits, shapes.top_k, True)),
            gigabytes_per_second(logits.numel() * element, ms),
        )
    )
    return rows


def cudnn_refusal(call, device) -> str:
    """Empty when cuDNN's attention alone runs `call`, else why not (torch would fall back)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device.type != "cuda":  # CPU attention ignores the backend list
        return "no cuDNN on this device: torch's own attention ran"
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            call()
    except RuntimeError as exc:
        return f"cuDNN refused it, so another backend ran: {str(exc).strip().splitlines()[0][:160]}"
    return ""


def fa3_runs(q) -> bool:
    """Whether FlashAttention 3 can take `q` here (installed, a Hopper GPU, a dtype it built)."""
    from kernels.flash_varlen import fa3_varlen_function

    function = fa3_varlen_function()
    return function is not None and q.dtype in function.dtypes


def flash_varlen_as(provider: str) -> contextlib.AbstractContextManager:
    """`provider` ("torch" or "fa3") as the varlen kernel for the block (`VLM_CATALOG_FLASH_VARLEN`)."""
    from kernels.dispatch import environment_variable
    from kernels.flash_varlen import FLASH_VARLEN_ENV_VAR

    return environment_variable(FLASH_VARLEN_ENV_VAR, provider)


FA3_NOTE = "sets VLM_CATALOG_FLASH_VARLEN's default"


def bench_attention(shapes: Shapes, dtype, device, timer) -> list[Row]:
    """The attention rows. Their `[flash varlen]` rows are torch's FlashAttention 2, pinned: the
    default (`auto`) would run FlashAttention 3 where it loads, and the `[fa3]` rows beside them
    would then compare FA3 with itself (as the H200 run of 2026-11-27 did)."""
    with flash_varlen_as("torch"):
        return _attention_rows(shapes, dtype, device, timer)


def _decode_variant_row(shape: str, kv_bytes: int, name: str, baseline: str, ms: float, baseline_ms: float,
                        same: bool) -> Row:
    """One of `_decode_variant_rows`: `same` says whether the two launches gave the same bits."""
    return Row(name, shape, ms, baseline, baseline_ms, gigabytes_per_second(kv_bytes, ms),
               note="" if same else "OUTPUT DIFFERS")


def _decode_variant_rows(shapes: Shapes, dtype, device, timer) -> list[Row]:
    """The FP8-cache decode as the engine launches it against its variants, at the decode cases
    and the engine's full batch, with lengths spread as a batch's are:
    - each tile's block ids loaded an iteration before its K/V
      (`kernels.paged_decode_attention.loads_block_ids_ahead`: configs of 3 or more stages).
      Where the config the engine picks has 2 stages (the H100 table's up to batch 128): against
      that config with 3 stages, the ids ahead. Where it has 3 or more (the table's batch 256):
      against the same config with the ids in the same iteration, which keeps one tile in flight;
    - a sequence's KV heads launched side by side (`launches_heads_together`), against the grid
      (sequence, KV head, split) that launched every sequence's head 0 first.
    A note says if the outputs are not bit for bit the same."""
    import torch

    from kernels.dispatch import KERNELS_OFF_ENV_VAR, environment_variable
    from kernels.paged_decode_attention import paged_decode_attention_triton
    from kernels.paged_decode_configs import get_decode_config

    rows = []
    fp8 = torch.float8_e4m3fn
    for batch, context in (*shapes.decode_cases, shapes.full_decode_case):
        lengths = spread_lengths(batch, context)
        k_cache, v_cache, block_tables, context_lens = _paged_cache(batch, context, shapes, dtype, device, lengths)
        k_cache, v_cache = k_cache.to(fp8), v_cache.to(fp8)
        q = torch.randn(batch, shapes.num_q_heads, shapes.head_dim, dtype=dtype, device=device)
        picked = get_decode_config(fp8, shapes.head_dim, batch, device)
        decode = partial(paged_decode_attention_triton, q, k_cache, v_cache, block_tables, context_lens,
                         shapes.head_dim**-0.5, max_context_len=max(lengths))
        kv_bytes = 2 * sum(lengths) * shapes.num_kv_heads * shapes.head_dim  # one byte each
        picked_label = f"{picked.block_n} positions, {picked.num_warps} warps, {picked.num_stages} stages"
        shape = f"B={batch} ctx={context} (0.4-1.6x)"
        engine_out, engine_ms = decode(), timer(decode)  # as the engine launches it
        variant_row = partial(_decode_variant_row, shape, kv_bytes)

        if picked.num_stages >= 3:  # the engine's launch loads the ids ahead: against the ids in the same iteration
            with environment_variable(KERNELS_OFF_ENV_VAR, "decode_ids_ahead"):
                same = torch.equal(engine_out, decode())
                rows.append(variant_row("paged_decode_attention[fp8 kv, ids ahead]",
                                        f"ids in the same iteration ({picked_label})", engine_ms, timer(decode), same))
        else:  # 2 stages: the same config on 3, the ids ahead, against it
            three_stages = partial(decode, config=replace(picked, num_stages=3, tuned=False))
            same = torch.equal(three_stages(), engine_out)
            rows.append(variant_row("paged_decode_attention[fp8 kv, ids ahead, 3 stages]",
                                    f"the engine's config ({picked_label})", timer(three_stages), engine_ms, same))
        with environment_variable(KERNELS_OFF_ENV_VAR, "decode_heads_together"):
            same = torch.equal(engine_out, decode())
            rows.append(variant_row("paged_decode_attention[fp8 kv, heads together]",
                                    "the grid (sequence, KV head, split)", engine_ms, timer(decode), same))
    return rows


def _attention_rows(shapes: Shapes, dtype, device, timer) -> list[Row]:
    import torch
    import torch.nn.functional as F

    from kernels.flash_varlen import (
        causal_with_context_supported,
        flash_varlen_attention,
        flash_varlen_usable,
    )
    from kernels.kv_cache import PackedContexts
    from kernels.paged_decode_attention import paged_decode_attention_triton
    from kernels.paged_prefill_attention import (
        paged_prefill_attention_per_sequence,
        paged_prefill_attention_reference,
        paged_prefill_attention_triton,
    )
    from kernels.varlen_attention import (
        _sdpa_segments,
        varlen_attention_reference,
        varlen_attention_triton,
    )

    rows = []
    element = torch.finfo(dtype).bits // 8
    scale = shapes.head_dim**-0.5
    for batch, context in shapes.decode_cases:
        k_cache, v_cache, block_tables, context_lens = _paged_cache(
            batch, context, shapes, dtype, device
        )
        q = torch.randn(batch, shapes.num_q_heads, shapes.head_dim, dtype=dtype, device=device)
        dense_k, dense_v = (
            _gathered(k_cache, block_tables, context),
            _gathered(v_cache, block_tables, context),
        )
        q_sdpa = q.unsqueeze(2)  # [B, Hq, 1, D]
        decode_args = (q, k_cache, v_cache, block_tables, context_lens, scale)
        sdpa = partial(F.scaled_dot_product_attention, q_sdpa, dense_k, dense_v, scale=scale)
        sdpa_ms = timer(partial(sdpa, enable_gqa=True))
        ms = timer(partial(paged_decode_attention_triton, *decode_args, max_context_len=context))
        kv_bytes = 2 * batch * context * shapes.num_kv_heads * shapes.head_dim * element
        rows.append(
            Row(
                "paged_decode_attention",
                f"B={batch} ctx={context}",
                ms,
                "SDPA, gathered K/V",
                sdpa_ms,
                gigabytes_per_second(kv_bytes, ms),
                target_speedup=1.0,
            )
        )
        # the same cache in FP8 (e4m3): half the bytes to read, widened in the kernel
        fp8_k, fp8_v = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
        fp8_ms = timer(partial(paged_decode_attention_triton, q, fp8_k, fp8_v, block_tables, context_lens, scale,
                               max_context_len=context))
        rows.append(
            Row(
                "paged_decode_attention[fp8 kv]",
                f"B={batch} ctx={context}",
                fp8_ms,
                "SDPA, gathered K/V",
                sdpa_ms,
                gigabytes_per_second(kv_bytes // element, fp8_ms),
                target_speedup=1.0,
            )
        )
        # the same FP8 cache with each page laid out head-major in memory (the same [blocks, block,
        # Hkv, D] view): a (page, KV head)'s rows, which one program reads, lie together instead of
        # interleaved with the other heads' at a stride of Hkv x D bytes (the engine's default layout;
        # VLM_CATALOG_KV_LAYOUT=head_major runs the engine on this one)
        head_major_k, head_major_v = head_major_pages(fp8_k), head_major_pages(fp8_v)
        head_major = partial(paged_decode_attention_triton, q, head_major_k, head_major_v, block_tables,
                             context_lens, scale, max_context_len=context)
        same = torch.equal(head_major(), paged_decode_attention_triton(q, fp8_k, fp8_v, block_tables, context_lens,
                                                                       scale, max_context_len=context))
        head_major_ms = timer(head_major)
        rows.append(
            Row(
                "paged_decode_attention[fp8 kv, head-major pages]",
                f"B={batch} ctx={context}",
                head_major_ms,
                "the engine's layout ([fp8 kv])",
                fp8_ms,
                gigabytes_per_second(kv_bytes // element, head_major_ms),
                note="" if same else "OUTPUT DIFFERS from the engine's layout",
            )
        )

    rows.extend(_decode_variant_rows(shapes, dtype, device, timer))

    for num_seqs, new_tokens, prefix in shapes.prefill_cases:
        context = prefix + new_tokens
        k_cache, v_cache, block_tables, context_lens = _paged_cache(
            num_seqs, context, shapes, dtype, device
        )
        q = torch.randn(
            num_seqs * new_tokens, shapes.num_q_heads, shapes.head_dim, dtype=dtype, device=device
        )
        cu_seqlens = (torch.arange(num_seqs + 1, device=device) * new_tokens).to(torch.int32)
        args = (q, k_cache, v_cache, block_tables, cu_seqlens, context_lens, scale)
        ms = timer(partial(paged_prefill_attention_triton, *args, max_query_len=new_tokens))
        visible = num_seqs * (
            new_tokens * prefix + new_tokens * (new_tokens + 1) / 2
        )  # causal (q, k) pairs
        flops = 4 * visible * shapes.num_q_heads * shapes.head_dim
        rows.append(
            Row(
                "paged_prefill_attention",
                f"{num_seqs}x{new_tokens} new, prefix {prefix}",
                ms,
                "SDPA per sequence (reference)",
                timer(partial(paged_prefill_attention_reference, *args)),
                teraflops(flops, ms),
            )
        )
        if flash_varlen_usable(q, "causal") and causal_with_context_supported(q):  # what the engine runs first
            lengths = [context] * num_seqs
            contexts = PackedContexts(block_tables, context_lens, lengths)  # one per step, shared by its layers
            own_kv = q[:, : shapes.num_kv_heads]  # not read here: every key comes out of the cache
            packed_flash = partial(paged_prefill_attention_per_sequence, q, own_kv, own_kv, *args[1:],
                                   [new_tokens] * num_seqs, lengths, contexts=contexts)
            packed_flash()  # computes the layout, as a step's first layer does
            flash_ms = timer(packed_flash)
            rows.append(
                Row(
                    "paged_prefill_attention[flash varlen, packed contexts]",
                    f"{num_seqs}x{new_tokens} new, prefix {prefix}",
                    flash_ms,
                    "the Triton kernel",
                    ms,
                    teraflops(flops, flash_ms),
                    target_speedup=1.0,
                )
            )
        if fa3_runs(q):  # the engine's call with FlashAttention 3 (kernels/flash_varlen.py)
            with flash_varlen_as("fa3"):
                if causal_with_context_supported(q):
                    lengths = [context] * num_seqs
                    own_kv = q[:, : shapes.num_kv_heads]  # read only for whole prompts (prefix 0)
                    fa3_call = partial(paged_prefill_attention_per_sequence, q, own_kv, own_kv, *args[1:],
                                       [new_tokens] * num_seqs, lengths,
                                       contexts=PackedContexts(block_tables, context_lens, lengths))
                    fa3_call()
                    fa3_ms = timer(fa3_call)
                    rows.append(Row("paged_prefill_attention[fa3]", f"{num_seqs}x{new_tokens} new, prefix {prefix}",
                                    fa3_ms, "the Triton kernel", ms, teraflops(flops, fa3_ms), target_speedup=1.0,
                                    note=FA3_NOTE))

    for num_seqs, new_tokens in shapes.fresh_prefill_cases:  # whole prompts: Triton or SDPA on their k/v
        k_cache, v_cache, block_tables, context_lens = _paged_cache(num_seqs, new_tokens, shapes, dtype, device)
        q = torch.randn(num_seqs * new_tokens, shapes.num_q_heads, shapes.head_dim, dtype=dtype, device=device)
        new_k, new_v = (torch.randn(num_seqs * new_tokens, shapes.num_kv_heads, shapes.head_dim, dtype=dtype,
                                    device=device) for _ in range(2))
        cu_seqlens = (torch.arange(num_seqs + 1, device=device) * new_tokens).to(torch.int32)
        args = (q, k_cache, v_cache, block_tables, cu_seqlens, context_lens, scale)
        ms = timer(partial(paged_prefill_attention_triton, *args, max_query_len=new_tokens))
        lengths = [new_tokens] * num_seqs
        sdpa = partial(paged_prefill_attention_per_sequence, q, new_k, new_v, *args[1:], lengths, lengths, threshold=1,
                       flash=False)
        sdpa_ms = timer(sdpa)
        flops = 4 * num_seqs * new_tokens * (new_tokens + 1) / 2 * shapes.num_q_heads * shapes.head_dim
        rows.append(
            Row(
                "paged_prefill_attention[fresh]",
                f"{num_seqs}x{new_tokens} whole prompts",
                ms,
                "SDPA per prompt on its own k/v",
                sdpa_ms,
                teraflops(flops, ms),
                note="sets SDPA_MIN_PREFILL_LEN (crossover by prompt length)",
            )
        )
        fresh_flash = partial(flash_varlen_attention, q, new_k, new_v, cu_seqlens, scale, new_tokens, causal=True)
        if flash_varlen_usable(q, "causal"):  # what the engine runs first for whole prompts
            ms = timer(fresh_flash)
            rows.append(
                Row(
                    "paged_prefill_attention[fresh, flash varlen]",
                    f"{num_seqs}x{new_tokens} whole prompts",
                    ms,
                    "SDPA per prompt on its own k/v",
                    sdpa_ms,
                    teraflops(flops, ms),
                    target_speedup=1.0,
                )
            )
        if fa3_runs(q):
            with flash_varlen_as("fa3"):
                ms = timer(fresh_flash)
            rows.append(Row("paged_prefill_attention[fresh, fa3]", f"{num_seqs}x{new_tokens} whole prompts", ms,
                            "SDPA per prompt on its own k/v", sdpa_ms, teraflops(flops, ms), target_speedup=1.0,
                            note=FA3_NOTE))

    for images, patches in shapes.vision_cases:
        total = images * patches
        q, k, v = (
            torch.randn(
                total, shapes.vision_heads, shapes.vision_head_dim, dtype=dtype, device=device
            )
            for _ in range(3)
        )
        cu_seqlens = (torch.arange(images + 1, device=device) * patches).to(torch.int32)
        vision_scale = shapes.vision_head_dim**-0.5
        varlen_args = (q, k, v, cu_seqlens, vision_scale)
        case = f"{images} images x {patches} patches"
        reference_ms = timer(partial(varlen_attention_reference, *varlen_args))
        flops = 4 * images * patches * patches * shapes.vision_heads * shapes.vision_head_dim

        def vision_row(name: str, ms: float, case=case, reference_ms=reference_ms, flops=flops, **extra) -> Row:
            return Row(name, case, ms, "SDPA per segment (reference)", reference_ms, teraflops(flops, ms), **extra)

        ms = timer(partial(varlen_attention_triton, *varlen_args, max_seqlen=patches))
        rows.append(vision_row("varlen_attention", ms, note="sets SDPA_MIN_SEGMENT_LEN (crossover by segment length)"))
        # the long images' per-segment SDPA with cuDNN's attention first (VLM_CATALOG_SDPA_BACKEND=cudnn)
        bounds = [(image * patches, (image + 1) * patches) for image in range(images)]
        cudnn_sdpa = partial(_sdpa_segments, q, k, v, bounds, vision_scale, torch.empty_like(q), backend="cudnn")
        rows.append(vision_row("varlen_attention[sdpa, cudnn]", timer(cudnn_sdpa),
                               note=cudnn_refusal(cudnn_sdpa, q.device) or "sets VLM_CATALOG_SDPA_BACKEND's default"))
        if flash_varlen_usable(q, "bidirectional"):  # what the vision tower runs first
            ms = timer(partial(flash_varlen_attention, *varlen_args, patches))
            rows.append(vision_row("varlen_attention[flash varlen]", ms, target_speedup=1.0))
        if fa3_runs(q):  # every image in one FlashAttention 3 call, long ones too
            with flash_varlen_as("fa3"):
                ms = timer(partial(flash_varlen_attention, *varlen_args, patches))
            rows.append(vision_row("varlen_attention[fa3]", ms, target_speedup=1.0, note=FA3_NOTE))
    return rows


@dataclass(frozen=True)
class ExpertFormat:
    """What `--tune-moe` times: FP8 expert weights (`fp8`, 128 x 128 blocks), FP8 activations too
    (`w8a8`), one scale per weight row and per token instead of blocks (`per_channel`)."""

    fp8: bool = False
    w8a8: bool = False
    per_channel: bool = False

    def __post_init__(self) -> None:
        if (self.w8a8 or self.per_channel) and not self.fp8:
            raise ValueError("w8a8 and per_channel tune FP8 experts: they need fp8")


def _fp8_experts(inputs, shapes: Shapes, per_channel: bool = False):
    """`inputs` with w13/w2 quantized to FP8 (block rows cut to divide the intermediate size, or
    one scale per row with `per_channel`), or None when the shapes allow no block."""
    from kernels.fp8 import per_channel_block, quantize_experts
    from vlm_catalog.model.fp8 import fitting_block

    block = per_channel_block(shapes.hidden, shapes.moe_intermediate) if per_channel else \
        fitting_block(shapes.moe_intermediate).block
    if shapes.moe_intermediate % block[0]:
        return None
    hidden, w13, w2, weights, ids = inputs
    (q13, s13), (q2, s2) = quantize_experts(w13, block), quantize_experts(w2, block)
    return (hidden, q13, q2, weights, ids), {"w13_scale": s13, "w2_scale": s2, "block_shape": block}


def bench_moe(shapes: Shapes, dtype, device, timer) -> list[Row]:
    """The fused MoE per token count, bf16 and FP8, with its align and routing launches. The
    per-expert loop (the torch reference) reads its counts on the host, so a GPU's graph timer
    times it host-launched, and its rows say so."""
    import torch

    from kernels.dispatch import KERNELS_OFF_ENV_VAR, environment_variable, fp8_accumulation
    from kernels.moe.align import moe_align_block_size_reference, moe_align_block_size_triton
    from kernels.moe.configs import get_moe_config
    from kernels.moe.fused_moe import (
        down_runs_persistent,
        fused_moe_reference,
        fused_moe_triton,
        moe_gemm_config,
    )

    rows = []
    element = torch.finfo(dtype).bits // 8
    for num_tokens in shapes.moe_token_counts:
        inputs = _moe_inputs(num_tokens, shapes, dtype, device)
        ids = inputs[4]
        config = get_moe_config(
            num_tokens,
            shapes.num_experts,
            shapes.hidden,
            shapes.moe_intermediate,
            dtype,
            shapes.top_k,
            device=device,
        )
        ms = timer(partial(fused_moe_triton, *inputs))
        flops, weight_bytes = _moe_cost(num_tokens, shapes, element)
        target = 3.0 if num_tokens == shapes.moe_target_tokens else None
        rows.append(
            Row(
                "fused_moe",
                f"T={num_tokens} (BLOCK_M={config.block_size_m})",
                ms,
                "per-expert loop (reference)",
                timer(partial(fused_moe_reference, *inputs)),
                f"{teraflops(flops, ms)}, weights {gigabytes_per_second(weight_bytes, ms)}",
                target_speedup=target,
            )
        )
        # the same experts in FP8 with 128 x 128 block scales (Qwen's -FP8): half the weight bytes;
        # then with one scale per row (and per token), applied after the K loops
        fp8, per_channel = _fp8_experts(inputs, shapes), _fp8_experts(inputs, shapes, per_channel=True)
        # (per-channel W8A8 sums each K step into float32 unless with fast accumulation: kernels/fp8.py)
        fp8_variants = {"fp8 experts": (fp8, False, False), "fp8 w8a8": (fp8, True, False),
                        "fp8 experts, per-channel": (per_channel, False, False),
                        "fp8 w8a8, per-channel": (per_channel, True, False),
                        "fp8 w8a8, per-channel, fast accumulation": (per_channel, True, True)}
        fp8_times = {}  # variant -> ms, the grouped-GEMM rows' baselines among them
        for name, (experts, activations, fast) in fp8_variants.items():
            if experts is None:  # the shapes allow no block
                continue
            with fp8_accumulation(fast):
                fp8_ms = fp8_times[name] = timer(partial(fused_moe_triton, *experts[0], **experts[1],
                                                         fp8_activations=activations))
            rows.append(
                Row(
                    f"fused_moe[{name}]",
                    f"T={num_tokens}",
                    fp8_ms,
                    "bf16 experts (Triton)",
                    ms,
                    f"{teraflops(flops, fp8_ms)}, weights {gigabytes_per_second(weight_bytes // element, fp8_ms)}",
                )
            )
        if "fp8 w8a8, per-channel" in fp8_times:
            # the down GEMM's input quantized by a launch of its own, where the gate/up epilogue would
            # (the prefill tiles): the row says what the epilogue saves (kernels/moe/fused_moe.py)
            with environment_variable(KERNELS_OFF_ENV_VAR, "moe_gate_up_quantizes"):
                launch_ms = timer(partial(fused_moe_triton, *per_channel[0], **per_channel[1], fp8_activations=True))
            rows.append(Row("fused_moe[fp8 w8a8, per-channel, quantize launch]", f"T={num_tokens}", launch_ms,
                            "fp8 w8a8, per-channel", fp8_times["fp8 w8a8, per-channel"],
                            teraflops(flops, launch_ms),
                            note="the down GEMM's input quantized by its own launch, not the gate/up epilogue"))
            # the down GEMM with one program per tile, where its tiles run persistent (the prefill
            # tiles, kernels/moe/fused_moe.py down_runs_persistent): the row says what that saves
            channel_config = moe_gemm_config(num_tokens, per_channel[0][1], shapes.top_k, None, True,
                                             per_channel[1]["block_shape"])
            if down_runs_persistent(channel_config):
                with environment_variable(KERNELS_OFF_ENV_VAR, "moe_down_persistent"):
                    per_tile_ms = timer(partial(fused_moe_triton, *per_channel[0], **per_channel[1],
                                                fp8_activations=True))
                rows.append(Row("fused_moe[fp8 w8a8, per-channel, one program per down tile]", f"T={num_tokens}",
                                per_tile_ms, "fp8 w8a8, per-channel", fp8_times["fp8 w8a8, per-channel"],
                                teraflops(flops, per_tile_ms),
                                note="the down GEMM launched one program per tile, not one per SM walking them"))
        rows += _grouped_gemm_rows(num_tokens, inputs, per_channel, ms, fp8_times.get("fp8 w8a8, per-channel"),
                                   flops, weight_bytes, element, shapes, timer)
        align_args = (ids, shapes.num_experts, config.block_size_m)
        ms = timer(partial(moe_align_block_size_triton, *align_args))
        rows.append(
            Row(
                "moe_align_block_size",
                f"T={num_tokens}",
                ms,
                "torch reference",
                timer(partial(moe_align_block_size_reference, *align_args)),
                gigabytes_per_second(ids.numel() * 4, ms),
            )
        )
        if ids.numel() <= 4096:  # where one launch may win: decode batches
            two = _align_ms(timer, align_args, 0)
            one = _align_ms(timer, align_args, ids.numel())
            rows.append(
                Row(
                    "moe_align_block_size[one launch]",
                    f"T={num_tokens}",
                    one,
                    "three launches (count, offsets, scatter)",
                    two,
                    gigabytes_per_second(ids.numel() * 4, one),
                    note="sets SINGLE_LAUNCH_MAX_PAIRS (the largest T*K where one launch wins)",
                )
            )
    rows += _route_and_align_rows(shapes, dtype, device, timer)
    rows += _norm_router_rows(shapes, dtype, device, timer)
    return rows


def _grouped_gemm_rows(num_tokens, inputs, per_channel, triton_ms, channel_triton_ms, flops, weight_bytes, element,
                       shapes, timer) -> list[Row]:
    """The experts on torch's grouped GEMMs (kernels/moe/grouped_gemm.py) against the Triton kernels'
    rows timed just before (`triton_ms`, bf16; `channel_triton_ms`, per-channel W8A8, the sums into
    float32 every K step on both), at prefill sizes. Where the GPU's torch fails the op, the row's
    note says why."""
    import torch

    from kernels.moe.grouped_gemm import device_supported, fused_moe_grouped_gemm

    if num_tokens < shapes.grouped_gemm_min_tokens or inputs[0].dtype != torch.bfloat16:
        return []
    rows = []
    variants = {"grouped_mm": (inputs, {}, "bf16", "bf16 experts (Triton)", triton_ms)}
    if per_channel is not None and channel_triton_ms is not None:
        variants["fp8 w8a8, per-channel, grouped_mm"] = (
            per_channel[0], dict(per_channel[1], fp8_activations=True), "w8a8_channel", "per-channel W8A8 (Triton)",
            channel_triton_ms)
    for name, (args, scales, kind, baseline, baseline_ms) in variants.items():
        device = args[0].device
        if not device_supported(device, kind) and (device.type == "cuda" or kind != "bf16"):
            continue  # not Hopper, or no such op in this torch (the FP8 one has no CPU kernel): nothing to time
        try:
            ms = timer(partial(fused_moe_grouped_gemm, *args, **scales))
        except Exception as error:  # noqa: BLE001 - e.g. no CPU kernel for the FP8 op: say so, time nothing
            rows.append(Row(f"fused_moe[{name}]", f"T={num_tokens}", float("nan"), baseline, baseline_ms, "-",
                            note=f"{type(error).__name__}: {str(error).strip().splitlines()[0][:120]}"))
            continue
        bytes_moved = weight_bytes // (element if kind == "w8a8_channel" else 1)
        rows.append(Row(f"fused_moe[{name}]", f"T={num_tokens}", ms, baseline, baseline_ms,
                        f"{teraflops(flops, ms)}, weights {gigabytes_per_second(bytes_moved, ms)}",
                        note="sets VLM_CATALOG_MOE_GEMM's default (kernels/moe/grouped_gemm.py)"))
    return rows


ROUTE_ALIGN_BENCH_TOKENS = (1, 4, 8, 16, 32, 64)  # decode batches around ROUTE_ALIGN_MAX_TOKENS


def _route_and_align_rows(shapes: Shapes, dtype, device, timer) -> list[Row]:
    """Routing and align in one launch against the two launches it replaces, at decode batches on
    both sides of ROUTE_ALIGN_MAX_TOKENS (whatever it is set to): the rows set it."""
    import torch

    from kernels.moe.configs import get_moe_config
    from kernels.moe.routing import (
        ROUTE_ALIGN_MAX_TILE,
        route_align_tile,
        route_topk_and_align_triton,
    )

    rows = []
    element = torch.finfo(dtype).bits // 8
    for num_tokens in ROUTE_ALIGN_BENCH_TOKENS:
        if route_align_tile(num_tokens, shapes.num_experts) > ROUTE_ALIGN_MAX_TILE:
            continue
        block_size = get_moe_config(
            num_tokens, shapes.num_experts, shapes.hidden, shapes.moe_intermediate, dtype, shapes.top_k, device=device
        ).block_size_m
        logits = torch.randn(num_tokens, shapes.num_experts, dtype=dtype, device=device)
        route_args = (logits, shapes.top_k, True, dtype)
        two = timer(partial(_route_then_align, route_args, shapes.num_experts, block_size))
        one = timer(partial(route_topk_and_align_triton, *route_args, block_size))
        rows.append(
            Row(
                "route_topk_and_align[one launch]",
                f"T={num_tokens}",
                one,
                "route_topk, then moe_align_block_size",
                two,
                gigabytes_per_second(logits.numel() * element, one),
                target_speedup=1.0 if num_tokens == 1 else None,
                note="sets ROUTE_ALIGN_MAX_TOKENS (the largest T where one launch wins)",
            )
        )
    return rows


NORM_ROUTER_BENCH_TOKENS = (1, 4, 8, 16)  # decode batches around NORM_ROUTER_MAX_TOKENS


def _norm_router_rows(shapes: Shapes, dtype, device, timer) -> list[Row]:
    """A MoE layer's post-attention add, norm and router logits in one launch against the two
    launches it replaces (the add-and-norm kernel, then the router's GEMM), at decode batches on
    both sides of NORM_ROUTER_MAX_TOKENS (whatever it is set to): the rows set it."""
    import torch
    import torch.nn.functional as F

    from kernels.moe.configs import get_moe_config
    from kernels.moe.routing import route_topk_and_align_triton
    from kernels.norm_router import add_rms_norm_route_triton, add_rms_norm_router_triton
    from kernels.rms_norm import fused_add_rms_norm_triton

    rows = []
    element = torch.finfo(dtype).bits // 8
    norm_weight = torch.randn(shapes.hidden, dtype=dtype, device=device)
    gate_weight = torch.randn(shapes.num_experts, shapes.hidden, dtype=dtype, device=device)

    def add_norm_then_router(x, residual):
        normed, new_residual = fused_add_rms_norm_triton(x, residual, norm_weight, 1e-6)
        return normed, new_residual, F.linear(normed, gate_weight)

    def three_launches(x, residual, block_size):  # what a decode layer launched before 2026-11-28
        _, _, logits = add_norm_then_router(x, residual)
        return route_topk_and_align_triton(logits, shapes.top_k, True, dtype, block_size)

    for num_tokens in NORM_ROUTER_BENCH_TOKENS:
        x = torch.randn(num_tokens, shapes.hidden, dtype=dtype, device=device)
        residual = torch.randn_like(x)
        one = timer(partial(add_rms_norm_router_triton, x, residual, norm_weight, 1e-6, gate_weight))
        two = timer(partial(add_norm_then_router, x, residual))
        bytes_moved = (gate_weight.numel() + 4 * x.numel()) * element  # the router's weight, two rows in, two out
        rows.append(
            Row(
                "add_rms_norm_router[one launch]",
                f"T={num_tokens} E={shapes.num_experts}",
                one,
                "fused_add_rms_norm, then the router's F.linear",
                two,
                gigabytes_per_second(bytes_moved, one),
                target_speedup=1.0 if num_tokens == 1 else None,
                note="sets NORM_ROUTER_MAX_TOKENS (the largest T where one launch wins)",
            )
        )
        block_size = get_moe_config(
            num_tokens, shapes.num_experts, shapes.hidden, shapes.moe_intermediate, dtype, shapes.top_k, device=device
        ).block_size_m
        routed = timer(partial(add_rms_norm_route_triton, x, residual, norm_weight, 1e-6, gate_weight, shapes.top_k,
                               True, dtype, block_size))
        rows.append(
            Row(
                "add_rms_norm_route[one launch]",
                f"T={num_tokens} E={shapes.num_experts} K={shapes.top_k}",
                routed,
                "fused_add_rms_norm, F.linear, route_topk_and_align",
                timer(partial(three_launches, x, residual, block_size)),
                gigabytes_per_second(bytes_moved, routed),
                target_speedup=1.0 if num_tokens == 1 else None,
                note="the norm-and-router launch's last program routes (norm_router_routes)",
            )
        )
    return rows


def _route_then_align(route_args, num_experts: int, block_size: int):
    """The two launches `route_topk_and_align` replaces for decode batches."""
    from kernels.moe.align import moe_align_block_size_triton
    from kernels.moe.routing import route_topk_triton

    return moe_align_block_size_triton(route_topk_triton(*route_args)[1], num_experts, block_size)


def _align_ms(timer, align_args, single_launch_max_pairs: int) -> float:
    """moe_align_block_size_triton timed with SINGLE_LAUNCH_MAX_PAIRS set as given."""
    import importlib

    align = importlib.import_module("kernels.moe.align")
    saved = align.SINGLE_LAUNCH_MAX_PAIRS
    align.SINGLE_LAUNCH_MAX_PAIRS = single_launch_max_pairs
    try:
        return timer(partial(align.moe_align_block_size_triton, *align_args))
    finally:
        align.SINGLE_LAUNCH_MAX_PAIRS = saved


def bench_dense_fp8(shapes: Shapes, dtype, device, timer) -> list[Row]:
    """The decoder's attention projections with FP8 weights (128-column blocks, rows cut to the
    fused q/k/v parts; and one scale per row), W8A16 and W8A8 (input quantization included),
    against bf16 cuBLAS; on a Hopper GPU also W8A8 on cuBLAS's block-scaled and row-wise FP8
    GEMMs (kernels/fp8_linear_cublas.py), which `kernels.fp8_linear` takes where they passed their
    check."""
    import torch
    import torch.nn.functional as F

    from kernels import fp8_linear_cublas as cublas
    from kernels.fp8 import per_channel_block, quantize
    from kernels.fp8_linear import fp8_linear_triton
    from vlm_catalog.model.fp8 import fitting_block

    q_size, kv_size = shapes.num_q_heads * shapes.head_dim, shapes.num_kv_heads * shapes.head_dim
    block = fitting_block(q_size, kv_size).block
    rows = []
    for label, in_features, out_features in (("qkv_proj", shapes.hidden, q_size + 2 * kv_size),
                                             ("o_proj", q_size, shapes.hidden)):
        weight = torch.randn(out_features, in_features, device=device, dtype=dtype) / in_features**0.5
        quantized, scale = quantize(weight, block)
        row_block = per_channel_block(in_features)
        per_row, row_scale = quantize(weight, row_block)
        for num_tokens in sorted({1, shapes.moe_target_tokens, shapes.num_tokens}):
            x = torch.randn(num_tokens, in_features, device=device, dtype=dtype)
            baseline_ms = timer(partial(F.linear, x, weight))
            flops = 2 * num_tokens * in_features * out_features
            variants = [("w8a16", partial(fp8_linear_triton, x, quantized, scale, block, None, False)),
                        ("w8a8", partial(fp8_linear_triton, x, quantized, scale, block, None, True)),
                        ("w8a16, per-channel", partial(fp8_linear_triton, x, per_row, row_scale, row_block, None, False)),
                        ("w8a8, per-channel", partial(fp8_linear_triton, x, per_row, row_scale, row_block, None, True))]
            if cublas.usable(x, quantized, scale, block):
                variants.append(("w8a8, cublas", partial(cublas.fp8_linear_cublas, x, quantized, scale, block=block)))
            if cublas.usable(x, per_row, row_scale, row_block):
                variants.append(("w8a8, per-channel, cublas",
                                 partial(cublas.fp8_linear_cublas, x, per_row, row_scale, block=row_block)))
            for variant, run in variants:
                ms = timer(run)
                rows.append(Row(
                    f"fp8_linear[{variant}]", f"{label} T={num_tokens} ({in_features}->{out_features})", ms,
                    "bf16 F.linear (cuBLAS)", baseline_ms,
                    f"{teraflops(flops, ms)}, weights {gigabytes_per_second(weight.numel(), ms)}",
                ))
        rows += _skinny_linear_rows(label, weight, timer)
    return rows


# BLOCK_N, BLOCK_K, warps, stages: kernels/skinny_linear.py's default first
SKINNY_CANDIDATES = ((16, 256, 4, 4), (32, 256, 4, 4), (16, 512, 4, 3), (16, 128, 4, 6), (32, 128, 4, 4),
                     (64, 128, 4, 4), (16, 256, 2, 4))


def _skinny_linear_rows(label: str, weight, timer) -> list[Row]:
    """A decode batch's 16-bit projection by `skinny_linear`'s kernel, each launch candidate
    against cuBLAS (F.linear), at 1 and SKINNY_MAX_ROWS rows: the rows set SKINNY_LAUNCH
    and SKINNY_MAX_ROWS."""
    import torch
    import torch.nn.functional as F

    from kernels.skinny_linear import (
        SKINNY_DTYPES,
        SKINNY_LAUNCH,
        SKINNY_MAX_ROWS,
        skinny_linear_triton,
    )

    if weight.dtype not in SKINNY_DTYPES:
        return []
    out_features, in_features = weight.shape
    rows = []
    for num_tokens in (1, SKINNY_MAX_ROWS):
        x = torch.randn(num_tokens, in_features, device=weight.device, dtype=weight.dtype)
        baseline_ms = timer(partial(F.linear, x, weight))
        for block_n, block_k, warps, stages in SKINNY_CANDIDATES:
            launch = dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
            ms = timer(partial(skinny_linear_triton, x, weight, None, launch))
            is_default = launch == SKINNY_LAUNCH
            rows.append(Row(
                f"skinny_linear[{block_n}x{block_k}, {warps} warps, {stages} stages]",
                f"{label} T={num_tokens} ({in_features}->{out_features})", ms, "bf16 F.linear (cuBLAS)",
                baseline_ms, f"weights {gigabytes_per_second(weight.numel() * weight.element_size(), ms)}",
                target_speedup=1.0 if is_default and num_tokens == 1 else None,
                note="the default; the others set SKINNY_LAUNCH" if is_default else "",
            ))
    return rows


BENCHMARK_GROUPS = {  # name -> the function that measures its rows, in the order they run
    "elementwise": bench_elementwise,
    "attention": bench_attention,
    "moe": bench_moe,
    "dense_fp8": bench_dense_fp8,
}


def parse_groups(text: str) -> tuple[str, ...]:
    """`--groups` (comma-separated names of BENCHMARK_GROUPS) as a tuple; unknown names are named."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in BENCHMARK_GROUPS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown benchmark group(s) {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(BENCHMARK_GROUPS)}")
    return names


def run_kernel_benchmarks(device, shapes: Shapes = GPU_SHAPES, dtype=None,
                          groups: tuple[str, ...] | None = None) -> dict:
    """Runs the benchmarks of `groups` (None: all of BENCHMARK_GROUPS) on `device`; returns
    {"device", "versions", "groups", "rows": [...], "errors": [...]}.

    A group of rows that raises (a kernel that crashes on this GPU, an out-of-memory) is
    reported under "errors" with its traceback printed, and the other groups still run."""
    import torch
    import triton

    from kernels.dispatch import fp8_fast_accumulation, kernels_off

    device = torch.device(device)
    dtype = dtype or torch.bfloat16
    torch.manual_seed(0)
    timer = make_graph_timer(device)
    rows, errors = [], []
    groups = groups or tuple(BENCHMARK_GROUPS)
    for group in groups:
        bench = BENCHMARK_GROUPS[group]
        try:
            rows += bench(shapes, dtype, device, timer)
        except Exception as exc:  # noqa: BLE001 - one group's failure must not cost the others' rows
            traceback.print_exc()
            errors.append({"group": group, "error": f"{type(exc).__name__}: {exc}"})
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else "cpu (Triton interpreter)",
        "dtype": str(dtype).removeprefix("torch."),
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "groups": list(groups),
        "kernels_off": sorted(kernels_off()),  # ops and fast paths turned off (VLM_CATALOG_KERNELS_OFF)
        "fp8_fast_accumulation": fp8_fast_accumulation(),  # VLM_CATALOG_FP8_FAST_ACCUMULATION
        "timer": "device time per call in CUDA graphs, L2 flushed (ms; do_bench where an op cannot be captured, "
                 "as its note says); host_ms: the host's time per call, launched back to back"
        if device.type == "cuda"
        else "wall-clock median (ms)",
        "date": time.strftime("%Y-%m-%d"),
        "rows": [
            {**asdict(row), "speedup": row.speedup, "meets_target": row.meets_target}
            for row in rows
        ],
        "errors": errors,  # groups of rows that failed: {"group", "error"}
    }


def print_table(report: dict) -> None:
    print(
        f"device: {report['device']}   dtype: {report['dtype']}   timer: {report['timer']}   "
        f"torch {report['versions']['torch']}, triton {report['versions']['triton']}"
    )
    header = (
        f"{'op':<24} {'shape':<34} {'triton ms':>10} {'host ms':>8} {'baseline ms':>12} {'speed-up':>9}  "
        f"{'rate':<36} baseline"
    )
    print(header)
    print("-" * len(header))
    for row in report["rows"]:
        flag = f"  [{row['note']}]" if row["note"] else ""
        if row["target_speedup"] is not None:
            verdict = "met" if row["meets_target"] else "MISSED"
            flag += f"  [target >= {row['target_speedup']:.1f}x: {verdict}]"
        host = "-" if row.get("host_ms") is None else f"{row['host_ms']:.4f}"
        print(
            f"{row['name']:<24} {row['shape']:<34} {row['triton_ms']:>10.4f} {host:>8} "
            f"{row['baseline_ms']:>12.4f} {row['speedup']:>8.2f}x  {row['rate']:<36} "
            f"{row['baseline']}{flag}"
        )
    for error in report.get("errors", []):
        print(f"FAILED {error['group']}: {error['error']}")


# --------------------------------------------------------------------------- MoE tuning
MEMORY_BOUND_ROWS_PER_EXPERT = 32  # up to here an expert's weights are read for a block or two of rows


def candidate_configs(rows_per_expert: float, max_block_k: int = 256):
    """The tiles `--tune-moe` times for a bucket with this many rows per expert.

    Up to MEMORY_BOUND_ROWS_PER_EXPERT (decode batches) the GEMMs stream each expert's weights
    once for one or two M blocks: longer K steps (up to `max_block_k`) and deeper pipelines keep
    more bytes in flight, and GROUP_M has nothing to group (vLLM's H100 table for this expert
    shape picks K steps of 128-256 and 2-5 stages there). Past it the tiles grow in M and N for
    reuse. `max_block_k`: 128 where a longer step cannot help or would change the sums (FP8
    weights in 128-column scale blocks; per-channel W8A8 adding into float32 once per K step)."""
    from kernels.moe.configs import MoeKernelConfig

    if rows_per_expert <= MEMORY_BOUND_ROWS_PER_EXPERT:
        block_ms, block_ks, group_ms, stages = (16, 32), (64, 128, 256), (1,), (3, 4, 5)
    else:
        block_ms, block_ks, group_ms, stages = (32, 64, 128), (64, 128), (1, 8), (3, 4)
    for block_m in block_ms:
        for block_n in (32, 64, 128):
            for block_k in (k for k in block_ks if k <= max_block_k):
                for group_m in group_ms:
                    for num_warps in (4, 8):
                        for num_stages in stages:
                            yield MoeKernelConfig(block_m, block_n, block_k, group_m, num_warps, num_stages,
                                                  tuned=True)


def _moe_tuning_inputs(num_tokens: int, shapes: Shapes, dtype, device,
                       experts: ExpertFormat) -> tuple[tuple, dict]:
    """fused_moe's positional inputs for one bucket, and its FP8 keyword arguments (or none)."""
    inputs = _moe_inputs(num_tokens, shapes, dtype, device)
    if not experts.fp8:
        return inputs, {}
    inputs, scales = _fp8_experts(inputs, shapes, experts.per_channel)
    return inputs, {**scales, "fp8_activations": experts.w8a8}


def _compile_moe_configs(device: str, num_tokens: int, shapes: Shapes, dtype_name: str, experts: ExpertFormat,
                         configs: list) -> int:
    """In a worker process: run fused_moe once per config, so Triton compiles it into its on-disk
    cache; returns how many ran (a config that fails is left to the timing loop to report)."""
    import torch

    from kernels.moe.fused_moe import fused_moe_triton

    inputs, scales = _moe_tuning_inputs(num_tokens, shapes, getattr(torch, dtype_name), torch.device(device),
                                        experts)
    ran = 0
    for config in configs:
        try:
            fused_moe_triton(*inputs, config=config, **scales)
            ran += 1
        except Exception:  # noqa: BLE001 - e.g. out of shared memory: the timing loop skips it too
            pass
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return ran


def moe_compile_pool(workers: int):
    """`workers` processes for `precompile_moe_configs`, reused over the buckets (each costs an
    interpreter, torch and a CUDA context to start)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))  # a forked CUDA context is unusable


def precompile_moe_configs(pool, workers: int, device, num_tokens: int, shapes: Shapes, dtype, experts: ExpertFormat,
                           configs: list) -> int:
    """Compile `configs` in the pool's `workers` processes before they are timed: compiling, not
    timing, is most of a tuning run, and Triton's on-disk cache hands the timing loop what the
    workers built. Returns the configs that compiled; a worker that fails only costs its share of
    the speed-up."""
    shares = [configs[index::workers] for index in range(workers) if configs[index::workers]]
    futures = [pool.submit(_compile_moe_configs, str(device), num_tokens, shapes, str(dtype).removeprefix("torch."),
                           experts, share) for share in shares]
    compiled = 0
    for future in futures:
        try:
            compiled += future.result()
        except Exception as error:  # noqa: BLE001 - the timing loop compiles what is missing
            print(f"  T={num_tokens}: a compile worker failed: {type(error).__name__}: {error}", file=sys.stderr)
    return compiled


def tune_moe(
    device, shapes: Shapes = GPU_SHAPES, dtype=None, buckets=None, max_candidates: int | None = None,
    experts: ExpertFormat = ExpertFormat(), compile_workers: int = 0, write_table: Path | None = None,
) -> dict[int, tuple]:
    """Times every candidate config per token bucket, the one in effect competing; prints and
    returns the best, {bucket: (ms, config, the config in effect's ms)}.
    All buckets at the model shape take a while (a few hundred compilations): pass
    `buckets` to split the work over several runs, and `compile_workers` to compile each
    bucket's candidates in that many processes first. `experts`: FP8 experts, W8A8 and
    per-channel ones each have entries of their own. Buckets of decode sizes are timed in CUDA
    graphs, as the engine runs them (`timer_for_tokens`). `write_table`: each bucket's best goes
    into this JSON table as soon as it is known (`kernels.tuned_configs`)."""
    import torch

    from kernels.moe.configs import TOKEN_BUCKETS
    from kernels.tuned_configs import device_name, device_processor, moe_entry, write_entries

    device = torch.device(device)
    dtype = dtype or torch.bfloat16
    timer, graph_timer = make_timer(device), make_graph_timer(device, measure_host=False)
    best = {}
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(moe_compile_pool(compile_workers)) if compile_workers > 1 else None
        for bucket in buckets or TOKEN_BUCKETS:
            key, ms, config, default_ms = _tune_moe_bucket(
                bucket, device, shapes, dtype, experts, timer_for_tokens(bucket, shapes, timer, graph_timer),
                max_candidates, pool, compile_workers)
            best[bucket] = (ms, config, default_ms)
            if write_table is not None:
                write_entries(write_table, device_name(device), processor=device_processor(device),
                              moe=[moe_entry(key, config, ms, default_ms)])
                print(f"# T={bucket}: written to {write_table}", flush=True)
    return best


def _tune_moe_bucket(bucket: int, device, shapes: Shapes, dtype, experts: ExpertFormat, timer,
                     max_candidates: int | None, pool, compile_workers: int) -> tuple:
    """The fastest candidate for one bucket, the config in effect among them: (its table key, ms,
    config, the config in effect's ms); printed with its line for MOE_CONFIGS."""
    from kernels.moe.configs import (
        MAX_SHARED_MEMORY_BYTES,
        format_config_entry,
        gate_up_shared_memory_bytes,
        get_moe_config,
        table_dtype,
    )
    from kernels.moe.fused_moe import asynchronous_k_loops, fused_moe_triton

    inputs, scales = _moe_tuning_inputs(bucket, shapes, dtype, device, experts)
    # per-channel experts' own entries are for K loops that do not wait per step; per-channel
    # W8A8 summing into float32 every step takes (and so tunes) the block-scaled W8A8 entries
    own_entries = asynchronous_k_loops(inputs[1], scales.get("block_shape"), experts.w8a8)
    weights_dtype = inputs[1].dtype
    key = (shapes.num_experts, shapes.hidden, shapes.moe_intermediate,
           table_dtype(weights_dtype, experts.w8a8, own_entries), bucket)
    in_effect = replace(get_moe_config(bucket, shapes.num_experts, shapes.hidden, shapes.moe_intermediate,
                                       weights_dtype, shapes.top_k, experts.w8a8, own_entries, device), tuned=True)
    results = []
    # K steps past 128: only where the K loop neither clamps them to its 128-column scale blocks nor
    # adds into float32 once per step (bf16 experts, and per-channel ones with asynchronous loops)
    searched = candidate_configs(bucket * shapes.top_k / shapes.num_experts,
                                 max_block_k=256 if own_entries or not experts.fp8 else 128)
    # tiles whose pipeline cannot fit a block's shared memory would only fail to compile
    searched = (config for config in searched
                if gate_up_shared_memory_bytes(config, weights_dtype.itemsize) <= MAX_SHARED_MEMORY_BYTES)
    candidates = [in_effect, *(config for config in searched if config != in_effect)][:max_candidates]  # in effect first
    if pool is not None:
        started = time.perf_counter()
        compiled = precompile_moe_configs(pool, compile_workers, device, bucket, shapes, dtype, experts, candidates)
        print(f"# T={bucket}: {compiled} of {len(candidates)} configs compiled by {compile_workers} "
              f"workers in {time.perf_counter() - started:.1f} s", flush=True)
    for config in candidates:
        run = partial(fused_moe_triton, *inputs, config=config, **scales)
        try:
            run()  # compiles; a config that cannot run fails here, before any capture
        except Exception as error:  # noqa: BLE001 - e.g. out of shared memory: skip the config
            print(f"  T={bucket}: skipped {config}: {type(error).__name__}", file=sys.stderr)
            continue
        results.append((timer(run), config, graph_note(timer)))  # (ms, config, how it was timed)
    ms, config, timing = min(results, key=lambda item: item[0])
    default_ms = next((item[0] for item in results if item[1] == in_effect), None)
    against = f", against {default_ms:.4f} ms for the config in effect" if default_ms is not None else ""
    print(f"# T={bucket}: {ms:.4f} ms (of {len(results)} configs{', ' + timing if timing else ''}){against}")
    print(
        format_config_entry(
            shapes.num_experts, shapes.hidden, shapes.moe_intermediate, weights_dtype, bucket, config,
            experts.w8a8, own_entries,
        ),
        flush=True,
    )
    return key, ms, config, default_ms


# --------------------------------------------------------------------------- decode tuning
def decode_candidates(max_candidates: int | None = None):
    """Launch settings `--tune-decode` tries (kernels/paged_decode_configs.py)."""
    from kernels.paged_decode_configs import DecodeKernelConfig

    candidates = [
        DecodeKernelConfig(block_n, num_warps, num_stages, programs_per_sm, min_split_tokens, tuned=True)
        for block_n in (32, 64, 128)
        for num_warps in (4, 8)
        for num_stages in (2, 3, 4)
        for programs_per_sm in (2, 4, 8)
        for min_split_tokens in (128, 256)
    ]
    return candidates[:max_candidates]


def tune_decode(device, shapes: Shapes = GPU_SHAPES, dtype=None, batches=None, fp8: bool = False,
                max_candidates: int | None = None, write_table: Path | None = None) -> dict[int, tuple]:
    """Times the split kernel's launch settings per batch bucket as the engine runs it (in a CUDA
    graph, fused cache write, `decode_graph_bound` as the host's bound, contexts spread around
    `decode_tuning_context`: `spread_lengths`);
    candidates that launch the same grid are timed once. Prints each bucket's best against the
    setting in effect (`get_decode_config`) with its line for DECODE_CONFIGS, and returns
    {batch: (ms, the setting in effect's ms, config)}.
    `fp8`: an FP8 (e4m3) cache. `write_table`: each bucket's best goes into this JSON table as
    soon as it is known (`kernels.tuned_configs`)."""
    import torch

    from kernels.attention_common import multiprocessor_count
    from kernels.checks import dtype_name
    from kernels.paged_decode_attention import (
        paged_decode_attention_with_kv_write_triton,
        split_plan,
    )
    from kernels.paged_decode_configs import (
        decode_batch_bucket,
        format_decode_config_entry,
        get_decode_config,
    )
    from kernels.tuned_configs import decode_entry, device_name, device_processor, write_entries

    device = torch.device(device)
    dtype = dtype or torch.bfloat16
    timer = make_graph_timer(device, measure_host=False)  # as the decode graphs run it: the device's time alone
    context, bound = shapes.decode_tuning_context, shapes.decode_graph_bound
    best = {}
    for batch in batches or shapes.decode_tuning_batches:
        lengths = spread_lengths(batch, context)
        k_cache, v_cache, block_tables, context_lens = _paged_cache(batch, context, shapes, dtype, device, lengths)
        if fp8:
            k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
        q = torch.randn(batch, shapes.num_q_heads, shapes.head_dim, dtype=dtype, device=device)
        k, v = (torch.randn(batch, shapes.num_kv_heads, shapes.head_dim, dtype=dtype, device=device) for _ in "kv")
        last = context_lens.long() - 1  # [B]: each sequence's current token
        slots = block_tables.long().gather(1, (last // shapes.block_size)[:, None])[:, 0] * shapes.block_size \
            + last % shapes.block_size

        def run(config, args=(q, k, v, k_cache, v_cache, slots, block_tables, context_lens)):
            return paged_decode_attention_with_kv_write_triton(*args, shapes.head_dim**-0.5, max_context_len=bound,
                                                               config=config)

        default = get_decode_config(k_cache.dtype, shapes.head_dim, batch, device)  # in effect (a table's, if any)
        default_ms = timer(partial(run, default))
        seen, results = set(), []
        for config in [replace(default, tuned=True), *decode_candidates(max_candidates)]:  # the default competes too
            splits, min_split_tokens = split_plan(batch, shapes.num_kv_heads, bound, device, config)
            launch = (config.block_n, config.num_warps, config.num_stages, splits, min_split_tokens if splits > 1 else 0)
            if launch in seen:
                continue
            seen.add(launch)
            try:
                results.append((timer(partial(run, config)), config))
            except Exception as error:  # noqa: BLE001 - e.g. out of shared memory: skip the config
                print(f"  B={batch}: skipped {config}: {type(error).__name__}", file=sys.stderr)
        ms, config = min(results, key=lambda item: item[0])
        kv_bytes = 2 * sum(lengths) * shapes.num_kv_heads * shapes.head_dim * k_cache.element_size()
        print(f"# B={batch} ctx {min(lengths)}-{max(lengths)}, mean {context} (bound {bound}, "
              f"{multiprocessor_count(device)} SMs): {ms:.4f} ms, "
              f"{gigabytes_per_second(kv_bytes, ms)}, against {default_ms:.4f} ms with the default "
              f"(of {len(results)} launches)")
        print(format_decode_config_entry(k_cache.dtype, shapes.head_dim, decode_batch_bucket(batch), config), flush=True)
        best[batch] = (ms, default_ms, config)
        if write_table is not None:
            key = (dtype_name(k_cache.dtype), shapes.head_dim, decode_batch_bucket(batch))
            write_entries(write_table, device_name(device), processor=device_processor(device),
                          paged_decode=[decode_entry(key, config, ms, default_ms)])
            print(f"# B={batch}: written to {write_table}", flush=True)
    return best


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="also write the numbers to this JSON file")
    parser.add_argument(
        "--tune-moe", action="store_true", help="search MoE block sizes per token bucket"
    )
    parser.add_argument(
        "--buckets", type=int, nargs="*",
        help="token buckets for --tune-moe, batch buckets for --tune-decode (default: all)",
    )
    parser.add_argument(
        "--tune-decode", action="store_true",
        help="search the paged decode attention's launch settings per batch bucket",
    )
    parser.add_argument(
        "--write-table", type=Path, default=None,
        help="--tune-moe / --tune-decode: also write each bucket's best into this JSON table "
             "(merged with what it holds; VLM_CATALOG_TUNED_CONFIGS=PATH makes an engine use it)",
    )
    parser.add_argument("--fp8", action="store_true",
                        help="--tune-moe with FP8 experts (128 x 128 scales); --tune-decode with an FP8 KV cache")
    parser.add_argument("--w8a8", action="store_true",
                        help="--tune-moe --fp8 with FP8 activations too (--quantization fp8_w8a8's GEMMs)")
    parser.add_argument("--per-channel", action="store_true",
                        help="--tune-moe --fp8 with one scale per weight row (and per token with --w8a8) "
                             "instead of 128 x 128 blocks (--quantization fp8_w8a8_channel's GEMMs)")
    parser.add_argument(
        "--compile-workers", type=int, default=None,
        help="--tune-moe: processes compiling each bucket's configs before they are timed "
             "(default: min(8, CPUs) on a GPU, none with --interpret)",
    )
    parser.add_argument(
        "--interpret",
        action="store_true",
        help="smoke run on CPU under the Triton interpreter with tiny shapes",
    )
    parser.add_argument(
        "--groups", type=parse_groups, default=None,
        help=f"the kernel table's groups to run, comma-separated (default: all of {','.join(BENCHMARK_GROUPS)})",
    )
    args = parser.parse_args(argv)
    if args.w8a8 and not (args.tune_moe and args.fp8):
        parser.error("--w8a8 goes with --tune-moe --fp8")
    if args.per_channel and not (args.tune_moe and args.fp8):
        parser.error("--per-channel goes with --tune-moe --fp8")
    if args.write_table is not None and not (args.tune_moe or args.tune_decode):
        parser.error("--write-table goes with --tune-moe or --tune-decode")

    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    if args.interpret:
        device, shapes = torch.device("cpu"), TINY_SHAPES
    elif torch.cuda.is_available():
        device, shapes = torch.device("cuda"), GPU_SHAPES
    else:
        print(
            "bench_kernels: no CUDA GPU here, nothing to benchmark "
            "(use --interpret for a CPU smoke run of the script)."
        )
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench_kernels: triton is not installed; install the 'gpu' extra.")
        return 0

    if args.tune_decode:
        tune_decode(device, shapes, batches=args.buckets, fp8=args.fp8, max_candidates=2 if args.interpret else None,
                    write_table=args.write_table)
        return 0
    if args.tune_moe:
        workers = args.compile_workers
        if workers is None:
            workers = 0 if args.interpret else min(8, os.cpu_count() or 1)
        experts = ExpertFormat(args.fp8, args.w8a8, args.per_channel)
        if args.interpret:  # the smoke run tries two configs per bucket
            tune_moe(device, shapes, buckets=args.buckets or shapes.moe_token_counts, max_candidates=2,
                     experts=experts, compile_workers=workers, write_table=args.write_table)
        else:
            tune_moe(device, shapes, buckets=args.buckets, experts=experts, compile_workers=workers,
                     write_table=args.write_table)
        return 0
    report = run_kernel_benchmarks(device, shapes, groups=args.groups)
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
