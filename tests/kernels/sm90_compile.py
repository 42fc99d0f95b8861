"""Compile every Triton kernel for an H100 (sm_90) without a GPU, as the wrappers launch it.

The interpreter tests check what the kernels compute, but the interpreter
accepts programs the GPU compiler rejects (wrong `tl.dot` shapes, type clashes
in loop-carried values, unsupported ops). Triton can compile ahead of time for
any target with its bundled ptxas, so this runs the whole GPU pipeline
(TTIR -> TTGIR -> LLVM IR -> PTX -> cubin) at the Qwen3-VL-30B-A3B shapes.

Each case calls a Triton wrapper (`kernels.*_triton`) on CPU tensors of those
shapes with every launch intercepted: nothing runs, and each launch's
arguments are specialized as Triton's launcher specializes them on a GPU
(pointers and integers divisible by 16 get `tt.divisibility`, integers equal to
1 become constants). The binary is the one a GPU would build: those attributes
decide whether loads are vectorized and software-pipelined, and with them the
registers, spills and shared memory. A hand-written signature without them
compiles a slower, unpipelined variant that uses less shared memory.

One line per launch: ptxas' registers and spill bytes (from its `-v` log), the
shared memory, warps and stages, the global accesses of a single 8- or
16-bit element in the PTX (loads the compiler could not vectorize), and the
scalar float16 -> bfloat16 conversions (Triton widens e4m3 to bfloat16 through
float16, one scalar instruction per element on sm_90), the single-byte loads
from shared memory (an 8-bit tile rearranged one byte at a time), and the SASS
instructions of the longest loop body (by the `nvdisasm` Triton bundles): what
a warp issues per iteration of a kernel's main loop, a static measure of its
cost that a CPU can take; and in that loop, the waits for every wgmma in
flight, which leave the tensor cores idle while the rest of an iteration runs;
and ptxas' reason where it serialized a kernel's wgmma (its "Potential
Performance Loss" note: then every wgmma waits for the one before it).
A kernel fails when it does not compile or needs more shared memory per block
than an H100 grants (227 KiB): its launch would raise `OutOfResources` on the
GPU; or when its PTX has no `griddepcontrol.wait` (kernels/jit/pdl.py): launched
with programmatic dependent launch, it could read what the grid before it still
writes.

Run as a script (``python -m tests.kernels.sm90_compile [--float32] [--moe-tile M,N,K,WARPS,STAGES]``,
the last to compile every fused-MoE GEMM with one tile) with
TRITON_INTERPRET unset (the interpreter replaces `triton.jit` functions);
`test_sm90_compile.py` does that in a subprocess. Exit status 0 when every
kernel compiles and fits.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # a cached binary would skip ptxas and its log
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

H100 = GPUTarget("cuda", 90, 32)
H100_MULTIPROCESSORS = 132
H100_MAX_SHARED_BYTES = 232448  # per block, with the opt-in Triton asks for (227 KiB)
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")

# Qwen3-VL-30B-A3B
HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, TOP_K, MOE_INTERMEDIATE = 128, 8, 768
MROPE_SECTION = (24, 20, 20)
VISION_HEADS, VISION_HEAD_DIM = 16, 72
CACHE_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN = 4096, 16, 32768
FP8_BLOCK = (128, 128)
BF16, FP32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn


@dataclass
class Launch:
    kernel: JITFunction
    arguments: dict[str, object]  # every parameter by name, defaults applied
    options: dict[str, int] = field(default_factory=dict)  # num_warps, num_stages, ...


@contextlib.contextmanager
def recorded_launches(on_launch: Callable[[Launch], None] | None = None) -> Iterator[list[Launch]]:
    """Every `kernel[grid](...)` inside is recorded instead of run; the wrappers size their
    grids and split counts for an H100. `on_launch`: called with each launch instead of keeping
    it in the list (whose launches hold their argument tensors)."""
    decode = importlib.import_module("kernels.paged_decode_attention")  # the package re-exports a function by that name

    launches: list[Launch] = []

    def record(self, *args, grid, warmup, **kwargs):
        options = {name: kwargs.pop(name) for name in LAUNCH_OPTIONS if name in kwargs}
        kwargs.pop("launch_pdl", None)  # how the launch runs, not what it compiles
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        bound.apply_defaults()
        launch = Launch(self, dict(bound.arguments), options)
        if on_launch is None:
            launches.append(launch)
        else:
            on_launch(launch)

    saved_run, saved_count = JITFunction.run, decode.multiprocessor_count
    JITFunction.run = record
    decode.multiprocessor_count = lambda device: H100_MULTIPROCESSORS
    try:
        yield launches
    finally:
        JITFunction.run, decode.multiprocessor_count = saved_run, saved_count


POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
                 torch.float8_e4m3fn: "*fp8e4nv", torch.int32: "*i32", torch.int64: "*i64"}
DIVISIBLE_BY_16 = [["tt.divisibility", 16]]


def specialize(value: object, specialize_value: bool, specialize_alignment: bool) -> tuple[str, bool]:
    """(Triton type, divisible by 16) of a launch argument, by the launcher's rules: a tensor is
    a pointer, aligned when its address is a multiple of 16 bytes; an integer equal to 1 (or None)
    becomes a constant, and one divisible by 16 says so. Written out here rather than imported
    from Triton's private C++ binding, so that the check runs on every Triton the project takes."""
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype], specialize_alignment and value.data_ptr() % 16 == 0
    if value is None or (specialize_value and isinstance(value, int) and not isinstance(value, bool) and value == 1):
        return "constexpr", False
    if isinstance(value, float):
        return "fp32", False
    if isinstance(value, int) and not isinstance(value, bool):
        kind = "i32" if -(2**31) <= value < 2**31 else "i64"
        return kind, specialize_value and specialize_alignment and value % 16 == 0
    raise TypeError(f"no specialization rule for a launch argument of type {type(value).__name__}")


def specialized_source(launch: Launch) -> ASTSource:
    """The launch as Triton's launcher would compile it: types, constants and attributes
    from the argument values."""
    kernel = launch.kernel
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = launch.arguments[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
            continue
        kind, divisible = specialize(value, not param.do_not_specialize, not param.do_not_specialize_on_alignment)
        signature[param.name] = kind
        if kind == "constexpr":  # an integer equal to 1, or None
            constexprs[param.name] = value
        elif divisible:
            attrs[(index,)] = DIVISIBLE_BY_16
    return ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)


@dataclass
class Compiled:
    registers: int | None  # None where ptxas printed no log (older Triton)
    spill_stores: int | None
    spill_loads: int | None
    shared: int
    num_warps: int
    num_stages: int
    narrow_accesses: int  # global loads and stores of one 8- or 16-bit element (in the PTX)
    bf16_from_f16: int  # scalar float16 -> bfloat16 conversions (in the PTX; how Triton widens e4m3 to bf16)
    shared_byte_loads: int  # single-byte loads from shared memory (in the PTX): an 8-bit tile moved byte by byte
    loop_instructions: int | None  # SASS instructions in the longest loop body (None: no nvdisasm)
    # waits in that loop for every wgmma issued (`WARPGROUP.DEPBAR.LE gsb0, 0x0`): each K step's
    # tensor-core work finishes before the next is issued (None: no nvdisasm)
    loop_full_wgmma_waits: int | None
    block_n: int | None  # the launch's BLOCK_N, where it has one: the loop's tile width
    # at the longest loop's first wait for asynchronous copies (`DEPBAR.LE SB0, N`), the copy
    # groups left in flight: 0 where every iteration waits for everything issued before it (one
    # tile ahead at most, whatever the stages); None without such a wait or without nvdisasm
    loop_copies_in_flight: int | None = None
    # a persistent launch (PERSISTENT): its longest loop is the flattened one over all its tiles'
    # K steps, the epilogue in a branch taken once per tile (its wait for the accumulator among them)
    persistent: bool = False
    # ptxas' reason for serializing the kernel's wgmma (its "Potential Performance Loss" note,
    # C7514 and kin): every wgmma then waits for the one before it, in every loop
    wgmma_serialized: str | None = None
    # FP8 x FP8 dots that carry their sum across K steps in the tensor core's accumulator (fewer
    # bits than float32): `maxNumImpreciseAcc` above the dot's K on a loop-carried accumulator
    fp8_sums_across_k: int = 0
    # the kernel waits for the grid before it (`griddepcontrol.wait`, kernels/jit/pdl.py): without
    # the wait, a launch with programmatic dependent launch could read what that grid still writes
    grid_dependency_wait: bool = True
    # the kernel lets the next grid launch (`griddepcontrol.launch_dependents`): without it, a
    # launch with PDL would start the next grid only once this one has ended, and gain nothing
    grid_dependency_trigger: bool = True
    # the kernel asks for memory into L2 before it waits for the grid before it (PREFETCH_WEIGHT,
    # kernels/jit/l2_prefetch.py: its weights, while that grid finishes)
    prefetches_before_wait: bool = False

    def summary(self) -> str:
        registers = "?" if self.registers is None else self.registers
        spills = "?" if self.spill_stores is None else f"{self.spill_stores}/{self.spill_loads}"
        return (f"{registers} registers, spills {spills} B (stores/loads), {self.shared} B shared, "
                f"{self.num_warps} warps, {self.num_stages} stages, {self.narrow_accesses} narrow accesses, "
                f"{self.bf16_from_f16} f16->bf16 conversions, {self.shared_byte_loads} shared byte loads, "
                f"longest loop {'?' if self.loop_instructions is None else self.loop_instructions} instructions"
                + ("" if self.block_n is None else f", BLOCK_N {self.block_n}")
                + f", {'?' if self.loop_full_wgmma_waits is None else self.loop_full_wgmma_waits} full wgmma waits"
                + ("" if self.loop_copies_in_flight is None
                   else f", {self.loop_copies_in_flight} copy groups in flight at the loop's wait")
                + ("" if self.wgmma_serialized is None else f", wgmma serialized by ptxas: {self.wgmma_serialized}")
                + ("" if not self.fp8_sums_across_k else f", {self.fp8_sums_across_k} FP8 dots summing across K")
                + (", persistent" if self.persistent else "")
                + (", weights prefetched into L2 before the wait" if self.prefetches_before_wait else "")
                + ("" if self.grid_dependency_wait else ", no griddepcontrol.wait")
                + ("" if self.grid_dependency_trigger else ", no griddepcontrol.launch_dependents"))


GLOBAL_ACCESS = re.compile(r"\b(?:ld|st)\.global[\w.:]*")


def narrow_accesses(ptx: str) -> int:
    """Global loads and stores that move a single 8- or 16-bit element: what a tile's loads
    become when the compiler cannot prove them aligned (one instruction per element)."""
    count = 0
    for instruction in GLOBAL_ACCESS.findall(ptx):
        parts = instruction.split(".")
        if not any(part in ("v2", "v4", "v8") for part in parts) and parts[-1][1:] in ("8", "16"):
            count += 1
    return count


# a TTIR dot: `%d = tt.dot %a, %b, %acc, ... {maxNumImpreciseAcc = N : i32} : tensor<MxKxf8..> * tensor<..xf8..>`
FP8_DOT = re.compile(r"tt\.dot %[\w.#]+, %[\w.#]+, %([\w.#]+),.*maxNumImpreciseAcc = (\d+).*"
                     r": tensor<\d+x(\d+)xf8\w*> \* tensor<\d+x\d+xf8\w*>")


def fp8_sums_across_k(ttir: str) -> int:
    """FP8 x FP8 dots whose tensor-core sum may run past one K step: an accumulator that is not a
    constant (a loop-carried sum, not a fresh zero) and more imprecise products allowed than
    the dot's K. Such a sum reaches float32 only after the loop (kernels.fp8.imprecise_accumulation)."""
    return sum(1 for accumulator, limit, k in FP8_DOT.findall(ttir)
               if not accumulator.startswith("cst") and int(limit) > int(k))


BF16_FROM_F16 = re.compile(r"\bcvt(?:\.rn)?\.bf16\.f16\b")
SHARED_BYTE_LOAD = re.compile(r"\bld\.shared\.[bsu]8\b")


NVDISASM = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
SASS_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
SASS_LABEL = re.compile(r"^\s*\.(L_x_\d+):")
SASS_BACKWARD_BRANCH = re.compile(r"\bBRA\b.*`\(\.(L_x_\d+)\)")
FULL_WGMMA_WAIT = re.compile(r"^WARPGROUP\.DEPBAR\.LE gsb0, 0x0\b")
COPY_WAIT = re.compile(r"^DEPBAR\.LE SB0, 0x([0-9a-f]+)\b")  # cp.async groups allowed still in flight
WGMMA_SERIALIZED = re.compile(r"wgmma\.mma_async instructions are serialized due to (.*?)\s+in the function")


def longest_loop(sass: str) -> list[str]:
    """The instructions of the longest loop body in an `nvdisasm -c` listing: from a label to a
    branch back to it. In a kernel with one main loop, what each iteration issues per warp; empty
    without a loop (the branch to itself that ends every kernel is not one)."""
    instructions: list[str] = []
    labels: dict[str, int] = {}
    longest: tuple[int, int] = (0, -1)
    for line in sass.splitlines():
        if label := SASS_LABEL.match(line):
            labels[label.group(1)] = len(instructions)
        elif instruction := SASS_INSTRUCTION.match(line):
            instructions.append(instruction.group(2))
            branch = SASS_BACKWARD_BRANCH.search(instruction.group(2))
            if branch and branch.group(1) in labels:
                start, end = labels[branch.group(1)], len(instructions) - 1
                if end > start and end - start > longest[1] - longest[0]:
                    longest = (start, end)
    return instructions[longest[0]:longest[1] + 1]


def sass_of(cubin: bytes) -> str | None:
    """The SASS listing of a cubin by the nvdisasm Triton bundles (None where it has none)."""
    if not NVDISASM.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([str(NVDISASM), "-c", file.name], check=True, capture_output=True, text=True).stdout


@contextlib.contextmanager
def compiling_for(target: GPUTarget) -> Iterator[None]:
    """Kernels' compile-time target checks (`tl.target_info.cuda_capability_geq`, which asks the
    active driver's device) answer for `target`, as they would on that GPU: there is none here."""
    from triton.language import target_info

    def current_target():
        return target

    current_target.__triton_builtin__ = True  # as Triton marks its own: callable while compiling
    with mock.patch.object(target_info, "current_target", current_target):
        yield


def compile_for(launch: Launch, target: GPUTarget):
    with compiling_for(target):
        return triton.compile(specialized_source(launch), target=target, options=launch.options)


def compile_launch(launch: Launch) -> Compiled:
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # Triton prints ptxas' -v log here
        compiled = compile_for(launch, H100)
    registers = re.search(r"Used (\d+) registers", log.getvalue())
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log.getvalue())
    sass = sass_of(compiled.asm["cubin"])
    loop = None if sass is None else longest_loop(sass)
    return Compiled(
        registers=int(registers.group(1)) if registers else None,
        spill_stores=int(spills.group(1)) if spills else None,
        spill_loads=int(spills.group(2)) if spills else None,
        shared=compiled.metadata.shared,
        num_warps=compiled.metadata.num_warps,
        num_stages=compiled.metadata.num_stages,
        narrow_accesses=narrow_accesses(compiled.asm["ptx"]),
        bf16_from_f16=len(BF16_FROM_F16.findall(compiled.asm["ptx"])),
        shared_byte_loads=len(SHARED_BYTE_LOAD.findall(compiled.asm["ptx"])),
        loop_instructions=None if loop is None else len(loop),
        loop_full_wgmma_waits=None if loop is None else sum(bool(FULL_WGMMA_WAIT.match(line)) for line in loop),
        loop_copies_in_flight=next((int(wait.group(1), 16) for line in loop or () if (wait := COPY_WAIT.match(line))),
                                   None),
        block_n=launch.arguments.get("BLOCK_N"),
        wgmma_serialized=serialized.group(1) if (serialized := WGMMA_SERIALIZED.search(log.getvalue())) else None,
        fp8_sums_across_k=fp8_sums_across_k(compiled.asm["ttir"]),
        persistent=bool(launch.arguments.get("PERSISTENT", False)),
        grid_dependency_wait="griddepcontrol.wait" in compiled.asm["ptx"],
        grid_dependency_trigger="griddepcontrol.launch_dependents" in compiled.asm["ptx"],
        prefetches_before_wait=prefetches_before_wait(compiled.asm["ptx"]),
    )


def prefetches_before_wait(ptx: str) -> bool:
    """Whether the PTX asks for a line into L2 (`prefetch.global.L2`) before `griddepcontrol.wait`."""
    prefetch, wait = ptx.find("prefetch.global.L2"), ptx.find("griddepcontrol.wait")
    return prefetch >= 0 and (wait < 0 or prefetch < wait)


@contextlib.contextmanager
def launched_with_pdl() -> Iterator[None]:
    """The wrappers launch as on a Hopper GPU with VLM_CATALOG_PDL=1 (their `launch_options` ask
    for programmatic dependent launch; here the tensors are on the CPU, where it asks for none)."""
    modules = [importlib.import_module(name) for name in ("kernels.skinny_linear", "kernels.norm_router")]
    with contextlib.ExitStack() as stack:
        for module in modules:
            stack.enter_context(mock.patch.object(module, "launch_options", lambda tensor: {"launch_pdl": True}))
        yield


def with_pdl(call: Callable[[], object]) -> Callable[[], object]:
    """`call` as `launched_with_pdl` launches it."""
    def launch():
        with launched_with_pdl():
            return call()
    return launch


# --------------------------------------------------------------------------- cases
def empty(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def qkv_views(tokens: int, dtype: torch.dtype = BF16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k and v [T, Hkv, D]: views of one fused projection, as the decoder makes them."""
    q, k, v = empty(tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype).split(
        [Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1
    )
    return (q.view(tokens, Q_HEADS, HEAD_DIM), k.view(tokens, KV_HEADS, HEAD_DIM),
            v.view(tokens, KV_HEADS, HEAD_DIM))


def kv_cache(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return empty(CACHE_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype), \
        empty(CACHE_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype)


def block_tables(batch: int) -> torch.Tensor:
    """[B, max_model_len / block_size]: as the CUDA graphs hold them."""
    return torch.arange(batch * (MAX_MODEL_LEN // BLOCK_SIZE), dtype=torch.int32).remainder(CACHE_BLOCKS).view(batch, -1)


def routing(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_weights [T, K] in the hidden dtype, topk_ids [T, K] int32, as the model routes."""
    ids = torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(tokens)]).to(torch.int32)
    return torch.full((tokens, TOP_K), 1 / TOP_K, dtype=BF16), ids


def moe_case(tokens: int, variant: str, config=None):
    """The model's MoE call (terms left unsummed) with bf16 (or `f16`) experts, or FP8 experts
    with 128 x 128 block scales (`w8a8`: and FP8 GEMM inputs); a "per-channel" variant has one
    scale per weight row (and per token). `config`: a `MoeKernelConfig` instead of the table's."""
    from kernels.fp8 import per_channel_block
    from kernels.moe.fused_moe import fused_moe_triton

    block = per_channel_block(HIDDEN, MOE_INTERMEDIATE) if "per-channel" in variant else FP8_BLOCK
    dtype = torch.float16 if variant == "f16" else BF16  # of the activations
    weight_dtype, fp8 = (dtype, {}) if variant in ("bf16", "f16") else (FP8, {
        "w13_scale": torch.ones(EXPERTS, -(-2 * MOE_INTERMEDIATE // block[0]), -(-HIDDEN // block[1])),
        "w2_scale": torch.ones(EXPERTS, -(-HIDDEN // block[0]), -(-MOE_INTERMEDIATE // block[1])),
        "block_shape": block,
        "fp8_activations": variant.startswith("w8a8"),
    })
    w13 = empty(EXPERTS, 2 * MOE_INTERMEDIATE, HIDDEN, dtype=weight_dtype)
    w2 = empty(EXPERTS, HIDDEN, MOE_INTERMEDIATE, dtype=weight_dtype)
    topk_weights, topk_ids = routing(tokens)
    fused_moe_triton(empty(tokens, HIDDEN, dtype=dtype), w13, w2, topk_weights.to(dtype), topk_ids, config, **fp8,
                     sum_experts=False)


def prefill_moe_tile():
    """128 x 128 x 128, 8 warps, 4 stages: the H100 table's W8A8 tile at 16k tokens, which per-channel
    experts take too (their K loops add into float32 every step, `fused_moe.asynchronous_k_loops`)."""
    from kernels.moe.configs import MoeKernelConfig

    return MoeKernelConfig(128, 128, 128, 1, 8, 4)


def decode_case(batch: int, context: int, cache_dtype: torch.dtype, fused_write: bool, dtype: torch.dtype = BF16,
                norm_rope: bool = False, merge_in_place: bool = True, config=None):
    """`norm_rope`: q and k raw, normed and rotated in the kernel (as the engine's decode steps run it);
    `merge_in_place=False`: the splits merged by the reduce kernel's launch (`decode_merge_in_place` off);
    `config`: launch settings other than the default's (a GPU model's tuned table, `full_batch_decode_config`)."""
    if not merge_in_place:
        from kernels.dispatch import KERNELS_OFF_ENV_VAR, environment_variable

        with environment_variable(KERNELS_OFF_ENV_VAR, "decode_merge_in_place"):
            return decode_case(batch, context, cache_dtype, fused_write, dtype, norm_rope, config=config)
    from kernels.paged_decode_attention import (
        paged_decode_attention_triton,
        paged_decode_attention_with_kv_write_triton,
    )
    from kernels.rotary import QKNormRope

    q, k, v = qkv_views(batch, dtype)
    k_cache, v_cache = kv_cache(cache_dtype)
    lens = torch.full((batch,), context, dtype=torch.int32)
    tables = block_tables(batch)
    hints = {"max_context_len": MAX_MODEL_LEN, "config": config}  # the bound the captured graphs pass
    if norm_rope:
        hints["qk_norm_rope"] = QKNormRope(empty(HEAD_DIM, dtype=dtype), empty(HEAD_DIM, dtype=dtype),
                                           torch.zeros(3, batch, dtype=torch.int64),
                                           empty(HEAD_DIM // 2, dtype=FP32), MROPE_SECTION, 1e-6)
    if fused_write:
        slots = torch.arange(batch, dtype=torch.int64)
        paged_decode_attention_with_kv_write_triton(q, k, v, k_cache, v_cache, slots, tables, lens, HEAD_DIM**-0.5,
                                                    **hints)
    else:
        paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5, **hints)


def full_batch_decode_config():
    """The H100 table's FP8-cache decode settings at batch 256 (2026-11-27): 128 positions a tile,
    4 warps, 3 stages, with which the split kernel loads each tile's block ids an iteration ahead."""
    from kernels.paged_decode_configs import DecodeKernelConfig

    return DecodeKernelConfig(block_n=128, num_warps=4, num_stages=3, programs_per_sm=8, min_split_tokens=256)


def prefill_case(cache_dtype: torch.dtype, dtype: torch.dtype = BF16):
    from kernels.paged_prefill_attention import paged_prefill_attention_triton

    q, _, _ = qkv_views(1024, dtype)  # two chunks of 512 after 1000 cached tokens each
    k_cache, v_cache = kv_cache(cache_dtype)
    cu_seqlens = torch.tensor([0, 512, 1024], dtype=torch.int32)
    lens = torch.tensor([1512, 1512], dtype=torch.int32)
    paged_prefill_attention_triton(q, k_cache, v_cache, block_tables(2), cu_seqlens, lens, HEAD_DIM**-0.5,
                                   max_query_len=512)


def vision_attention_case(dtype: torch.dtype = BF16):
    from kernels.varlen_attention import varlen_attention_triton
    from kernels.vision_rotary import vision_rotary_triton

    patches = 4 * 1024
    qkv = empty(patches, 3, VISION_HEADS, VISION_HEAD_DIM, dtype=dtype)  # [N, 3, h, d]
    q, k, v = qkv.unbind(dim=1)
    cos, sin = empty(patches, VISION_HEAD_DIM, dtype=FP32), empty(patches, VISION_HEAD_DIM, dtype=FP32)
    if dtype == BF16:
        q, k = vision_rotary_triton(q, k, cos, sin)
    else:
        q, k = q.contiguous(), k.contiguous()
    cu_seqlens = torch.arange(0, patches + 1, 1024, dtype=torch.int32)
    varlen_attention_triton(q, k, v, cu_seqlens, VISION_HEAD_DIM**-0.5, max_seqlen=1024)


def cases(include_float32: bool) -> list[tuple[str, Callable[[], object]]]:
    """(label, a call of Triton wrappers at the model's shapes)."""
    from kernels.activation import silu_and_mul_quantize_triton, silu_and_mul_triton
    from kernels.fp8 import per_channel_block, quantize_activations_triton
    from kernels.fp8_input import Fp8InputLayout
    from kernels.fp8_linear import fp8_linear_triton
    from kernels.kv_cache import reshape_and_cache_triton
    from kernels.moe.align import moe_align_block_size_triton
    from kernels.moe.fused_moe import moe_gemm_config
    from kernels.moe.routing import route_topk_and_align_triton, route_topk_triton
    from kernels.norm_router import add_rms_norm_route_triton, add_rms_norm_router_triton
    from kernels.rms_norm import (
        fused_add_rms_norm_triton,
        fused_sum_add_rms_norm_triton,
        gathered_sum_add_rms_norm_triton,
        rms_norm_triton,
    )
    from kernels.rotary import qk_norm_mrope_triton
    from kernels.skinny_linear import skinny_linear_triton

    tokens = 256
    weight = empty(HIDDEN)
    specs: list[tuple[str, Callable[[], object]]] = [
        ("rms_norm", lambda: rms_norm_triton(empty(tokens, HIDDEN), weight, 1e-6)),
        ("fused_add_rms_norm", lambda: fused_add_rms_norm_triton(empty(tokens, HIDDEN), empty(tokens, HIDDEN),
                                                                 weight, 1e-6)),
        ("fused_sum_add_rms_norm[K=8]", lambda: fused_sum_add_rms_norm_triton(  # the MoE's terms, summed in the norm
            empty(tokens, TOP_K, HIDDEN), empty(tokens, HIDDEN), weight, 1e-6)),
        ("gathered_sum_add_rms_norm[K=8]", lambda: gathered_sum_add_rms_norm_triton(  # the grouped-GEMM MoE's rows
            empty(tokens * TOP_K, HIDDEN), torch.zeros(tokens, TOP_K, dtype=torch.int64), empty(tokens, TOP_K, dtype=FP32),
            empty(tokens, HIDDEN), weight, 1e-6)),
        # the norms writing the next W8A8 GEMM's FP8 input (kernels/fp8_input.py): q/k/v's on cuBLAS with
        # per-channel weights (one scale per token, rows padded to 4), the experts' with 128-wide blocks
        ("fused_sum_add_rms_norm[K=8, FP8 out per token]", lambda: fused_sum_add_rms_norm_triton(
            empty(tokens, TOP_K, HIDDEN), empty(tokens, HIDDEN), weight, 1e-6,
            Fp8InputLayout(group=HIDDEN, row_multiple=4))),
        ("fused_add_rms_norm[FP8 out in 128 columns, kept]", lambda: fused_add_rms_norm_triton(
            empty(tokens, HIDDEN), empty(tokens, HIDDEN), weight, 1e-6,
            Fp8InputLayout(group=128, row_multiple=4, scales_row_index_fastest=True, keep_unquantized=True))),
        *((f"add_rms_norm_router[T={count}]",  # a decode layer's post-attention norm and router logits
           lambda count=count: add_rms_norm_router_triton(empty(count, HIDDEN), empty(count, HIDDEN), weight, 1e-6,
                                                          empty(EXPERTS, HIDDEN)))
          for count in (1, 8)),
        *((f"add_rms_norm_route[T={count}]",  # the same, its last program routing and aligning too
           lambda count=count: add_rms_norm_route_triton(
               empty(count, HIDDEN), empty(count, HIDDEN), weight, 1e-6, empty(EXPERTS, HIDDEN), TOP_K, True, BF16,
               moe_gemm_config(count, empty(EXPERTS, 2 * MOE_INTERMEDIATE, HIDDEN), TOP_K).block_size_m))
          for count in (1, 8)),
        *((f"skinny_linear[{name}, T={count}]",  # a decode batch's dense projections
           lambda count=count, k=k, n=n: skinny_linear_triton(empty(count, k), empty(n, k)))
          for name, k, n in (("qkv", HIDDEN, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM), ("o", Q_HEADS * HEAD_DIM, HIDDEN))
          for count in (1, 8)),
        # the batch-1 decode step's graph with VLM_CATALOG_PDL=1: the weights asked for before the wait
        ("skinny_linear[qkv, T=1, launched with PDL]",
         with_pdl(lambda: skinny_linear_triton(empty(1, HIDDEN), empty((Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)))),
        ("add_rms_norm_route[T=1, launched with PDL]", with_pdl(lambda: add_rms_norm_route_triton(
            empty(1, HIDDEN), empty(1, HIDDEN), weight, 1e-6, empty(EXPERTS, HIDDEN), TOP_K, True, BF16,
            moe_gemm_config(1, empty(EXPERTS, 2 * MOE_INTERMEDIATE, HIDDEN), TOP_K).block_size_m))),
        ("qk_norm_mrope", lambda: qk_norm_mrope_triton(
            *qkv_views(tokens)[:2], empty(HEAD_DIM), empty(HEAD_DIM), torch.zeros(3, tokens, dtype=torch.int64),
            empty(HEAD_DIM // 2, dtype=FP32), MROPE_SECTION, 1e-6)),
        ("silu_and_mul", lambda: silu_and_mul_triton(empty(tokens, 2 * MOE_INTERMEDIATE))),
        ("silu_and_mul_quantize", lambda: silu_and_mul_quantize_triton(empty(tokens, 2 * MOE_INTERMEDIATE))),
        ("quantize_activations[fp8]", lambda: quantize_activations_triton(empty(tokens, HIDDEN), 128)),
        *((f"reshape_and_cache[{name} cache]",
           lambda dtype=dtype: reshape_and_cache_triton(*qkv_views(tokens)[1:], *kv_cache(dtype),
                                                        torch.arange(tokens, dtype=torch.int64)))
          for name, dtype in (("bf16", BF16), ("fp8", FP8))),
        ("route_topk[bf16 weights]", lambda: route_topk_triton(empty(tokens, EXPERTS), TOP_K, True, BF16)),
        *((f"route_topk_and_align[T={count}]",
           lambda count=count: route_topk_and_align_triton(
               empty(count, EXPERTS), TOP_K, True, BF16,
               moe_gemm_config(count, empty(EXPERTS, 2 * MOE_INTERMEDIATE, HIDDEN), TOP_K).block_size_m))
          for count in (1, 16)),
        *((f"moe_align_block_size[T={count}]",
           lambda count=count: moe_align_block_size_triton(routing(count)[1], EXPERTS, 16))
          for count in (1, 32, 4096)),
        ("vision_rotary + varlen_attention[bf16, D=72]", vision_attention_case),
    ]
    attention_dtypes = [BF16] + ([FP32] if include_float32 else [])
    for dtype in attention_dtypes:
        name = "bf16" if dtype == BF16 else "fp32"
        for cache_name, cache_dtype in ((name, dtype), ("fp8", FP8)):
            for batch, context, fused in ((1, 27000, True), (128, 1000, True), (32, 2000, False)):
                specs.append((
                    f"paged_decode[{name}, {cache_name} cache, B={batch}, ctx {context}, fused write={fused}]",
                    lambda b=batch, c=context, cd=cache_dtype, f=fused, d=dtype: decode_case(b, c, cd, f, d),
                ))
            for batch in (1, 256):  # the engine's decode steps: q and k normed and rotated in the kernel
                specs.append((
                    f"paged_decode[{name}, {cache_name} cache, B={batch}, ctx 2000, fused write, q/k norm+rope]",
                    lambda b=batch, cd=cache_dtype, d=dtype: decode_case(b, 2000, cd, True, d, norm_rope=True),
                ))
            if cache_name == "fp8":  # the engine's full decode batch on the H100 table's 3 stages
                specs.append((
                    f"paged_decode[{name}, fp8 cache, B=256, ctx 2000, fused write, q/k norm+rope, 3 stages]",
                    lambda d=dtype: decode_case(256, 2000, FP8, True, d, norm_rope=True,
                                                config=full_batch_decode_config()),
                ))
            if cache_name == name:  # the splits merged by a second launch (decode_merge_in_place off)
                specs.append((
                    f"paged_decode[{name}, {cache_name} cache, B=32, ctx 2000, reduce launch]",
                    lambda cd=cache_dtype, d=dtype: decode_case(32, 2000, cd, False, d, merge_in_place=False),
                ))
            specs.append((f"paged_prefill[{name}, {cache_name} cache]",
                          lambda cd=cache_dtype, d=dtype: prefill_case(cd, d)))
        if dtype == FP32:
            specs.append(("varlen_attention[fp32, D=72]", lambda: vision_attention_case(FP32)))
    for count in (1, 256, 4096, 8192):
        for variant in ("bf16", "fp8", "w8a8", "fp8 per-channel", "w8a8 per-channel"):
            if count == 4096 and variant not in ("fp8", "w8a8"):  # only the block-scaled tiles differ there
                continue
            specs.append((
                f"fused_moe[T={count}, {variant} experts{', fp8 activations' if variant.startswith('w8a8') else ''}]",
                lambda count=count, variant=variant: moe_case(count, variant),
            ))
    # the H100 table's prefill tile for per-channel W8A8 (BLOCK_N 128 = the down input's 128-column
    # group): the gate/up epilogue quantizes its product (QUANTIZE_OUT), the down loop scales each step
    specs.append(("fused_moe[T=16384, w8a8 per-channel experts, fp8 activations, 128 x 128 x 128 tile]",
                  lambda: moe_case(16384, "w8a8 per-channel", prefill_moe_tile())))
    # --dtype float16: its epilogues round like the bf16 ones (kernels/jit/rounding.py)
    specs.append(("fused_moe[T=8192, f16 experts]", lambda: moe_case(8192, "f16")))
    for count in (1, 256, 8192):  # the dense FP8 linear (qkv_proj), W8A16 and W8A8, blocks and per-channel
        for fp8_activations in (False, True):
            for block, blocks in ((FP8_BLOCK, ""), (per_channel_block(HIDDEN), " per-channel")):
                out_features = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
                specs.append((
                    f"fp8_linear[T={count}, {'w8a8' if fp8_activations else 'fp8 weights'}{blocks}]",
                    lambda count=count, a=fp8_activations, n=out_features, block=block: fp8_linear_triton(
                        empty(count, HIDDEN), empty(n, HIDDEN, dtype=FP8),
                        torch.ones(-(-n // block[0]), -(-HIDDEN // block[1])), block,
                        bias=empty(n) if count == 256 else None, fp8_activations=a),
                ))
    return specs


MOE_KERNELS = ("moe_gate_up_silu_kernel", "moe_down_kernel")


def with_moe_tile(launch: Launch, tile: tuple[int, ...] | None) -> Launch:
    """The launch with `tile` = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) where it is a
    fused-MoE GEMM (`--moe-tile`: compare tiles on equal terms), else as it is."""
    if tile is None or launch.kernel.fn.__name__ not in MOE_KERNELS:
        return launch
    block_m, block_n, block_k, num_warps, num_stages = tile
    arguments = {**launch.arguments, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
    return Launch(launch.kernel, arguments, {**launch.options, "num_warps": num_warps, "num_stages": num_stages})


def main(argv: list[str]) -> int:
    failures = 0
    torch.manual_seed(0)
    tile = None
    if "--moe-tile" in argv:  # e.g. --moe-tile 128,64,64,8,3
        tile = tuple(int(size) for size in argv[argv.index("--moe-tile") + 1].split(","))
    only = argv[argv.index("--only") + 1] if "--only" in argv else ""  # e.g. --only "w8a8 per-channel"
    for label, call in cases(include_float32="--float32" in argv):
        if only not in label:
            continue
        try:
            with recorded_launches() as launches:
                call()
        except Exception:  # noqa: BLE001 - report every case, then fail
            failures += 1
            print(f"{label}: FAILED before any compile\n{traceback.format_exc()}", flush=True)
            continue
        for launch in (with_moe_tile(launch, tile) for launch in launches):
            start = time.perf_counter()
            name = f"{label} / {launch.kernel.fn.__name__}"
            try:
                compiled = compile_launch(launch)
            except Exception:  # noqa: BLE001
                failures += 1
                print(f"{name}: FAILED\n{traceback.format_exc()}", flush=True)
                continue
            status = "ok"
            if compiled.shared > H100_MAX_SHARED_BYTES:
                failures += 1
                status = f"FAILED (more shared memory than an H100 block has: {H100_MAX_SHARED_BYTES} B)"
            elif not compiled.grid_dependency_wait:
                failures += 1
                status = "FAILED (no griddepcontrol.wait: a launch with PDL could race the grid before it)"
            elif not compiled.grid_dependency_trigger:
                failures += 1
                status = "FAILED (no griddepcontrol.launch_dependents: with PDL the next grid would wait for the end)"
            print(f"{name}: {status} ({compiled.summary()}) [{time.perf_counter() - start:.1f}s]", flush=True)
    if not only:
        failures += not compiles_before_hopper()
    return 1 if failures else 0


A100 = GPUTarget("cuda", 80, 32)


def compiles_before_hopper() -> bool:
    """The norm kernel built for an A100 (sm_80): it must compile, without the grid dependency
    instructions, which exist from sm_90 on (kernels/jit/pdl.py leaves them out there)."""
    from kernels.rms_norm import rms_norm_triton

    with recorded_launches() as launches:
        rms_norm_triton(empty(16, HIDDEN), empty(HIDDEN), 1e-6)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            ptx = compile_for(launches[0], A100).asm["ptx"]
    except Exception:  # noqa: BLE001
        print(f"rms_norm for sm_80: FAILED\n{traceback.format_exc()}", flush=True)
        return False
    if "griddepcontrol" in ptx:
        print("rms_norm for sm_80: FAILED (griddepcontrol before Hopper: ptxas would refuse it)", flush=True)
        return False
    print("rms_norm for sm_80: ok (no griddepcontrol)", flush=True)
    return True


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
