"""Every Triton kernel compiles for an H100 (sm_90), here, without a GPU, as its wrapper
launches it at the model's shapes, and fits an H100's shared memory.

Runs `tests/kernels/sm90_compile.py` in a subprocess: the compiler needs the real
`triton.jit` functions, which the interpreter set up by this directory's
conftest replaces. The bfloat16 kernels (every launch, about 205 s on this 2-core VM in
2026-11) and the float32 attention variants (exact dot products, slower still) are `slow`:
`make test-slow`, which CI runs after the default suite. The three launches built under
VLM_CATALOG_FP8_FAST_ACCUMULATION (about 20 s) stay in the default run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_compile(*flags: str, **variables: str) -> subprocess.CompletedProcess:
    """sm90_compile with `flags`, in this environment plus `variables`, without the interpreter
    (and without VLM_CATALOG_FP8_FAST_ACCUMULATION unless `variables` sets it)."""
    pytest.importorskip("triton")
    env = {key: value for key, value in os.environ.items()
           if key not in ("TRITON_INTERPRET", "VLM_CATALOG_FP8_FAST_ACCUMULATION")}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env.update(variables)
    return subprocess.run(
        [sys.executable, "-m", "tests.kernels.sm90_compile", *flags],
        cwd=REPO_ROOT,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )


def jit_kernels() -> set[str]:
    """The launchable @triton.jit functions (named *_kernel; the others are device helpers)."""
    return {name for path in (REPO_ROOT / "kernels" / "jit").glob("*.py")
            for name in re.findall(r"^def (\w+_kernel)\(", path.read_text(), flags=re.MULTILINE)}


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    result = run_compile()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAILED" not in result.stdout
    compiled = set(re.findall(r" / (\w+): ok \(", result.stdout))
    assert compiled == jit_kernels()  # every kernel, through the wrappers that launch it
    # the launcher's specialization reached the compiler: the fused-MoE GEMMs are pipelined
    # (the stages' buffers make their shared memory several times one tile's)
    moe = re.search(r"fused_moe\[T=8192, bf16 experts\] / moe_gate_up_silu_kernel: ok \(.* (\d+) B shared",
                    result.stdout)
    assert moe and int(moe.group(1)) > 64 * 1024, result.stdout
    # the vision tower's head stride (72) is a multiple of 8, not 16: only the kernels'
    # `tl.multiple_of` hints (`kernels/strides.py`) vectorize their loads. Without them the
    # attention kernel used 255 registers, spilled ~670 B and loaded one element at a time,
    # and the rotary kernel made 64 single-element accesses.
    for kernel in ("vision_rotary_kernel", "varlen_attention_kernel"):
        line = re.search(rf"varlen_attention\[bf16, D=72\] / {kernel}: ok \((.*)\)", result.stdout)
        assert line and "spills 0/0 B" in line.group(1) and " 0 narrow accesses" in line.group(1), result.stdout
    # decode over an FP8 cache with a bf16 query widens e4m3 to float16 (packed, exact) and
    # runs both dots in float16: widening to bf16 cost a scalar conversion per element, 160 per
    # loop iteration. V is read as words and widened before the dot: read as bytes, it went
    # through shared memory one byte at a time (64 loads per thread per iteration).
    # The prefill kernel runs float16 dots over an FP8 cache too.
    fp8_decode = re.findall(r"paged_decode\[bf16, fp8 cache, .*\] / paged_decode_split_kernel: ok \((.*)\)",
                            result.stdout)
    fp8_prefill = re.findall(r"paged_prefill\[bf16, fp8 cache\] / paged_prefill_attention_kernel: ok \((.*)\)",
                             result.stdout)
    # three launches as the bench times them, and three as the engine's decode steps run them (q/k
    # normed and rotated in the kernel; at batch 256 also on the H100 table's 3 stages)
    assert len(fp8_decode) == 6 and len(fp8_prefill) == 1, result.stdout
    for line in fp8_decode + fp8_prefill:
        assert " 0 f16->bf16 conversions" in line and " 0 shared byte loads" in line, result.stdout
    # The GEMMs over FP8 weights with bf16 inputs widen the weights by inline PTX
    # (kernels/jit/fp8_widen.py): 16-136 scalar conversions per kernel before, none now.
    fp8_weights = re.findall(r"\[T=\d+, fp8 (?:per-channel )?(?:experts|weights)(?: per-channel)?\] / \w+: ok \((.*)\)",
                             result.stdout)
    # 3 token counts x (2 MoE GEMMs + the dense one) x 2 scale layouts, and the block-scaled MoE at T=4096
    assert len(fp8_weights) == 20, result.stdout
    assert all(" 0 f16->bf16 conversions" in line for line in fp8_weights), result.stdout
    # The decode loop's SASS per iteration of 64 positions, every cache dtype and batch: 945-1117
    # instructions before the changes above, the compile-time block size and the fused write's
    # token after the loop; 470-590 after, on Triton 3.6 and 3.9. Per position, so that a tuned
    # tile width (paged_decode_configs.py) keeps the bound.
    decode_loops = re.findall(r"paged_decode\[.*\] / paged_decode_split_kernel: ok \(.*longest loop (\d+|\?) "
                              r"instructions, BLOCK_N (\d+),", result.stdout)
    assert len(decode_loops) == 12, result.stdout  # 5 per cache dtype, FP8's on 3 stages, the reduce launch's
    if all(count != "?" for count, _ in decode_loops):  # Triton bundles nvdisasm
        per_position = [int(count) / int(block_n) for count, block_n in decode_loops]
        assert 1.5 <= min(per_position) and max(per_position) <= 11, per_position  # two dots, a softmax: not under 1.5
    # No FP8 x FP8 dot sums past one K step in the tensor core's accumulator, which keeps fewer
    # bits than float32: per-channel W8A8 GEMMs, which scale after their K loops, add each step's
    # sum into float32 (kernels.fp8.imprecise_accumulation), as the block-scaled ones do. Summed
    # across the loop, the fused MoE at T=4096 was 2.4-4.0e-2 of max |expected| from the
    # reference on an H100 against 1.0-1.4e-2 with block scales (test_fused_moe_fp8.py failed).
    assert "FP8 dots summing across K" not in result.stdout, result.stdout
    per_channel = re.findall(r"\[T=8192, w8a8 per-channel(?: experts, fp8 activations)?\] / \w+: ok", result.stdout)
    assert len(per_channel) == 3, result.stdout  # gate/up, down and the dense GEMM
    # ptxas serializes no kernel's wgmma (its "Potential Performance Loss" note, e.g. C7514). On
    # Triton 3.9, LLVM narrowed the bf16 fused-MoE epilogues' float32 multiplies of rounded
    # accumulators to 16-bit ones, and ptxas then made every wgmma of their K loops (prefill
    # tiles, T=8192) wait for the one before it: 8 and 4 full waits per iteration
    # (kernels/jit/rounding.py). Triton 3.6 built the same source without them.
    serialized = re.findall(r"^(.*): ok \(.*wgmma serialized by ptxas: (.*)\)", result.stdout, flags=re.MULTILINE)
    assert not serialized, serialized
    # A persistent down GEMM (the prefill tiles) waits once more in its flattened loop: for the
    # accumulator, in the epilogue's branch, once per tile; its K steps keep one wgmma in flight.
    moe_16_bit = re.findall(r"fused_moe\[T=\d+, (?:bf16|f16) experts\] / \w+: ok \(.*, (\d+|\?) full wgmma waits"
                            r"(.*)\)", result.stdout)
    assert len(moe_16_bit) == 8, result.stdout
    assert all(waits in ("0", "?") or (waits == "1" and "persistent" in rest) for waits, rest in moe_16_bit), \
        result.stdout
    persistent = re.findall(r"fused_moe\[T=(\d+), [^\]]*\] / (\w+): ok \(.*, persistent\)", result.stdout)
    assert {kernel for _, kernel in persistent} == {"moe_down_kernel"}, result.stdout  # gate/up: never
    assert {int(tokens) for tokens, _ in persistent} == {8192, 16384}, result.stdout  # the 128-row tiles only
    attention = re.search(r"D=72\] / varlen_attention_kernel: ok \(.* (\d+) B shared", result.stdout)
    assert attention and int(attention.group(1)) > 32 * 1024, result.stdout  # pipelined (cp.async stages)


def test_per_channel_w8a8_with_fast_accumulation_keeps_the_wgmma_chain_asynchronous():
    """Under VLM_CATALOG_FP8_FAST_ACCUMULATION the per-channel W8A8 GEMMs sum the whole K loop in
    the tensor core (the check above sees it) and never wait for a wgmma inside the loop, at
    their own tiles (`fused_moe.asynchronous_k_loops`). Adding each step's sum into float32
    waits for that step's wgmma: at T=8192 (Triton 3.9) 141 / 110 loop instructions and no full
    wait here, against 196 / 131 and 2 / 1 waits by default (gate/up / down). The down GEMM runs
    persistent on these 128-row tiles: its flattened loop's one full wait is the epilogue's, once
    per tile, in a branch its K steps skip."""
    result = run_compile("--only", "T=8192, w8a8 per-channel", VLM_CATALOG_FP8_FAST_ACCUMULATION="1")
    assert result.returncode == 0, result.stdout + result.stderr
    launches = re.findall(r"\] / (\w+): ok \(.*, (\d+|\?) full wgmma waits, .*?(\d+) FP8 dots summing across K"
                          r"(, persistent)?\)", result.stdout)
    assert sorted(launches) == sorted([("moe_gate_up_silu_kernel", "0", "2", ""),
                                       ("moe_down_kernel", "1", "1", ", persistent"),
                                       ("fp8_linear_kernel", "0", "1", "")]) or \
        sorted(launches) == sorted([("moe_gate_up_silu_kernel", "?", "2", ""),
                                    ("moe_down_kernel", "?", "1", ", persistent"),
                                    ("fp8_linear_kernel", "?", "1", "")]), result.stdout


def test_the_norms_store_their_fp8_output_8_bytes_a_thread():
    """The norms writing a W8A8 GEMM's FP8 input (`rms_norm_kernel` with QUANTIZE) store it from
    the row's own layout: 8 bytes a thread, no byte through shared memory. On Triton 3.6 (the GPU
    image's) the first form, which reshaped the row to [groups, GROUP] and stored from there, went
    through shared memory and stored one byte per instruction (8 narrow stores a thread, 2 KiB of
    shared memory); Triton 3.9 built that form wide. `make test-floor` runs this on 3.6."""
    result = run_compile("--only", "FP8 out")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = re.findall(r"FP8 out.*\] / rms_norm_kernel: ok \((.*)\)", result.stdout)
    assert len(lines) == 2, result.stdout  # one scale per token, and 128-column groups
    for line in lines:
        assert " 0 narrow accesses" in line and " 0 shared byte loads" in line, line
        assert int(re.search(r"(\d+) B shared", line).group(1)) <= 256, line  # the reductions' scratch only


def test_the_decode_loop_keeps_more_than_one_tile_in_flight_on_three_stages():
    """The FP8-cache decode at the engine's full batch on the H100 table's settings (128 positions a
    tile, 3 stages) waits at the top of its loop with a copy group still in flight per stage past
    two: its block ids are loaded an iteration ahead (`loads_block_ids_ahead`). Loaded in the same
    iteration (`decode_ids_ahead` off, the loop before), the K/V loads are indirect and the loop
    waits for every copy (0 in flight), on Triton 3.6 as on 3.9."""
    label = r"paged_decode\[bf16, fp8 cache, B=256, .*3 stages\] / paged_decode_split_kernel: ok \((.*)\)"
    for kernels_off, in_flight in (("", "2"), ("decode_ids_ahead", "0")):
        result = run_compile("--only", "3 stages", VLM_CATALOG_KERNELS_OFF=kernels_off)
        assert result.returncode == 0, result.stdout + result.stderr
        line = re.search(label, result.stdout)
        assert line, result.stdout
        if "longest loop ?" not in line.group(1):  # Triton bundles nvdisasm
            assert f", {in_flight} copy groups in flight at the loop's wait" in line.group(1), (kernels_off, line)


def test_kernels_launched_with_pdl_ask_for_their_weights_before_the_wait():
    """Launched with programmatic dependent launch, the skinny projection and the norm-and-router
    launch prefetch their weights into L2 before `griddepcontrol.wait` (in their PTX), on Triton
    3.6 as on 3.9; with `pdl_weight_prefetch` off they read nothing before it."""
    for kernels_off, prefetched in (("", True), ("pdl_weight_prefetch", False)):
        result = run_compile("--only", "launched with PDL", VLM_CATALOG_KERNELS_OFF=kernels_off)
        assert result.returncode == 0, result.stdout + result.stderr
        lines = re.findall(r"launched with PDL\] / (\w+): ok \((.*)\)", result.stdout)
        assert {kernel for kernel, _ in lines} == {"skinny_linear_kernel", "add_rms_norm_router_kernel"}, result.stdout
        for kernel, line in lines:
            assert ("weights prefetched into L2 before the wait" in line) == prefetched, (kernels_off, kernel, line)


@pytest.mark.slow
def test_float32_attention_kernels_compile_for_sm90():
    result = run_compile("--float32")
    assert result.returncode == 0, result.stdout + result.stderr
