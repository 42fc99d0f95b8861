"""Which Triton kernel variants the engine's warm-up launches, and which a run after it adds.

A variant a serving run meets first is compiled (or loaded from Triton's disk cache) on the
step's thread, in the middle of serving: a second or more on a GPU each time
(`vlm_catalog.bench.run_diagnostics` counts them in the GPU benchmark's timed runs). The warm-up
(`vlm_catalog/engine/warmup.py`) is meant to leave none: this runs the engine here, without a
GPU, at Qwen3-VL-30B-A3B's widths (random weights, `--layers` decoder layers and one vision
block, the benchmark's per-channel W8A8 weights and FP8 KV cache, asynchronous scheduling),
first its warm-up, then a run of synthetic catalogue records at realistic image sizes, and
prints the variants the run launched that the warm-up did not.

Every `kernel[grid](...)` is recorded instead of run (`tests/kernels/sm90_compile.py`'s
interception), and its variant is what Triton's launcher keys its cache on: the constexprs, the
launch options, and per argument its type and whether it is 1 or divisible by 16 (a pointer:
aligned to 16 bytes), by `sm90_compile.specialize`. The GPU's choices are taken on CPU tensors:
Triton where `auto` takes it on CUDA, the H100's multiprocessor count, and a stand-in for
FlashAttention's varlen call and for SDPA (zeros; `--flash fa2` sends long sequences to
SDPA as FlashAttention 2 does, `fa3` sends the varlen call every length). Nothing computes what a kernel would, so
`torch.empty` allocates zeros: routing, sampling and the rest see zeros, not garbage.

Not covered: CUDA graphs (their replays launch nothing; their capture runs at start-up, before
the warm-up, for every captured batch size), cuBLAS's FP8 GEMMs (the dense projections take the
Triton kernel here, a superset of the launches).

    python -m tests.engine.warmup_variants [--records 32] [--flash fa2|fa3] [--layers 1] [--json FILE]

It also counts what the run's prefill-sized forward passes (more than `PREFILL_SIZED` tokens)
ask of the host: their Triton launches and the torch ops they dispatch (allocations and views
included), per forward. The difference between `--layers 1` and `--layers 2` is one decoder
layer's share. Each is a launch (or an allocator call) the GPU host pays for in an eager step.

Exit status 0 when the run launched no variant the warm-up did not. `test_warmup_variants.py`
runs it in a subprocess (TRITON_INTERPRET must be unset: the interpreter replaces `triton.jit`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

from tests.kernels.sm90_compile import H100_MULTIPROCESSORS, Launch, recorded_launches, specialize  # noqa: E402

Variant = tuple  # (kernel name, launch options, per parameter: constexpr value or (type, divisible by 16))
PREFILL_SIZED = 1024  # tokens: a forward pass above this counts as a prefill step's (module doc)


class PrefillOps:
    """The Triton launches and torch ops of the text model's prefill-sized forward passes."""

    def __init__(self) -> None:
        self.forwards = 0
        self.tokens = 0
        self.launches: Counter[str] = Counter()
        self.torch_ops: Counter[str] = Counter()
        self.inside = False

    def wrap(self, decoder) -> None:
        """Count inside `decoder.forward` from now on (an instance attribute over the method)."""
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self

        class CountOps(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counts.torch_ops[func.overloadpacket.__name__] += 1
                return func(*args, **(kwargs or {}))

        forward = decoder.forward

        def counted_forward(input_ids, *args, **kwargs):
            if input_ids.shape[0] <= PREFILL_SIZED:
                return forward(input_ids, *args, **kwargs)
            self.forwards += 1
            self.tokens += input_ids.shape[0]
            self.inside = True
            try:
                with CountOps():
                    return forward(input_ids, *args, **kwargs)
            finally:
                self.inside = False

        decoder.forward = counted_forward

    def launched(self, launch: Launch) -> None:
        if self.inside:
            self.launches[launch.kernel.fn.__name__] += 1

    def report(self, layers: int) -> dict:
        """Per forward: the launches and torch ops, the commonest ops named."""
        forwards = max(self.forwards, 1)
        return {"forwards": self.forwards, "tokens_mean": self.tokens / forwards, "layers": layers,
                "triton_launches": sum(self.launches.values()) / forwards,
                "torch_ops": sum(self.torch_ops.values()) / forwards,
                "launches_by_kernel": {name: count / forwards for name, count in self.launches.most_common()},
                "torch_ops_by_name": {name: count / forwards for name, count in self.torch_ops.most_common(12)}}


def variant(launch: Launch) -> Variant:
    """The key Triton's launcher would find or compile this launch under (module doc)."""
    parameters = []
    for param in launch.kernel.params:
        value = launch.arguments[param.name]
        if param.is_constexpr:
            parameters.append((param.name, repr(value)))
        else:
            parameters.append((param.name, specialize(value, not param.do_not_specialize,
                                                      not param.do_not_specialize_on_alignment)))
    return launch.kernel.fn.__name__, tuple(sorted(launch.options.items())), tuple(parameters)


def variants_by_kernel(variants: set[Variant]) -> dict[str, int]:
    return dict(sorted(Counter(name for name, _, _ in variants).items()))


def describe(missing: Variant, seen: set[Variant]) -> str:
    """A variant the warm-up did not launch, by how it differs from the warm-up's nearest one."""
    name, options, parameters = missing
    same_kernel = [v for v in seen if v[0] == name]
    if not same_kernel:
        return f"{name}: never launched in the warm-up"

    def differences(other: Variant) -> list[str]:
        changed = [f"{p}={value!r} (warm-up: {o!r})"
                   for (p, value), (_, o) in zip(parameters, other[2]) if value != o]
        if options != other[1]:
            changed.append(f"options {dict(options)} (warm-up: {dict(other[1])})")
        return changed

    return f"{name}: {', '.join(min((differences(v) for v in same_kernel), key=len))}"


@contextlib.contextmanager
def gpu_choices_on_cpu(flash: str) -> Iterator[None]:
    """The engine's CUDA choices on CPU tensors (module doc)."""
    from kernels import attention_common, dispatch, flash_varlen

    def stand_in_varlen(q, k, v, *args, **kwargs):  # FlashAttention's varlen call, computing nothing
        return torch.zeros_like(q)

    def stand_in_sdpa(query, key, value, *args, **kwargs):  # SDPA (long sequences under FlashAttention 2)
        return query.new_zeros((*query.shape[:-1], value.shape[-1]))

    def h100_multiprocessors(device):
        return H100_MULTIPROCESSORS

    patches = [
        (dispatch, "AUTO_DEVICE_TYPES", ("cuda", "cpu")),
        (flash_varlen, "FLASH_DEVICE_TYPES", ("cuda", "cpu")),
        (flash_varlen, "flash_varlen_function", lambda: stand_in_varlen),
        (flash_varlen, "flash_varlen_provider", lambda: "fa3" if flash == "fa3" else "torch"),
        (flash_varlen, "_check_bottom_right", lambda q: None),
        (torch.nn.functional, "scaled_dot_product_attention", stand_in_sdpa),
        (torch, "empty", torch.zeros),
        (torch, "empty_like", torch.zeros_like),
        # the module that defines it, and those that imported it by name
        *((module, "multiprocessor_count", h100_multiprocessors) for module in (
            attention_common, importlib.import_module("kernels.moe.fused_moe"),
            importlib.import_module("kernels.paged_decode_attention"))),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def build_model(scratch: Path, layers: int):
    """(checkpoint directory, random model): the benchmark's fastest quantization (module doc)."""
    from kernels.fp8 import per_channel_block
    from vlm_catalog.bench.random_model import (
        QWEN3_VL_30B_A3B,
        benchmark_checkpoint_dir,
        random_model,
    )
    from vlm_catalog.model.fp8 import Fp8BlockQuantization
    from vlm_catalog.model.text import dense_input_widths

    shapes = {**QWEN3_VL_30B_A3B,
              "text_config": {**QWEN3_VL_30B_A3B["text_config"], "num_hidden_layers": layers},
              "vision_config": {**QWEN3_VL_30B_A3B["vision_config"], "depth": 1, "deepstack_visual_indexes": [0]}}
    checkpoint = benchmark_checkpoint_dir(scratch / "checkpoint", shapes)
    model = random_model(checkpoint, "cpu", torch.bfloat16)
    text = model.config.text
    decoder = model.language_model
    for experts in decoder.moe_experts():  # --quantization fp8_w8a8_channel, as bench_gpu's quantize_model
        experts.quantize_(Fp8BlockQuantization(*per_channel_block(text.hidden_size, text.moe_intermediate_size)))
        experts.fp8_activations = True
    decoder.use_fp8_linears(Fp8BlockQuantization(*per_channel_block(*dense_input_widths(text))), quantize_present=True)
    return checkpoint, model


def build_engine(checkpoint: Path, model):
    """The benchmark's engine settings over `model` (bench_gpu's make_engine), warmed up as it starts."""
    from vlm_catalog.engine.config import EngineConfig
    from vlm_catalog.engine.llm_engine import LLMEngine

    config = EngineConfig(model=checkpoint, device="cpu", dtype="bfloat16", max_num_seqs=256,
                          max_num_batched_tokens=16384, enable_prefix_caching=False,
                          scheduling_policy="shortest_prompt_first", max_model_len=32768, kv_cache_dtype="fp8",
                          kv_cache_memory_bytes=512 << 20, async_scheduling=True, warmup=True,
                          tune_cpu_allocator=False)
    return LLMEngine(config, prebuilt_model=model)


def run_records(engine, scratch: Path, count: int, output_tokens: int) -> int:
    """`count` synthetic catalogue records at realistic image sizes, all queued at once and sampled
    as the benchmark samples; returns the steps taken."""
    from vlm_catalog.data.loader import load_catalogue
    from vlm_catalog.data.synthetic.generator import make_catalog
    from vlm_catalog.engine.generation_config import QWEN3_VL_SAMPLING
    from vlm_catalog.preprocess.prompt import build_messages

    records = list(load_catalogue(make_catalog(scratch / "catalogue", count, 0, image_size="realistic")))
    params = QWEN3_VL_SAMPLING.params(max_tokens=output_tokens, ignore_eos=True, output_kind="final_only")
    for index, record in enumerate(records):
        engine.add_request(build_messages(record), params, f"record-{index}")
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished and output.error:
                raise RuntimeError(f"{output.request_id} failed: {output.error}")
        steps += 1
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=6)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--flash", choices=("fa2", "fa3"), default="fa2",
                        help="the varlen call as FlashAttention 2 (long sequences to SDPA) or 3 (every length)")
    parser.add_argument("--json", type=Path, default=None, help="write the variants by phase there")
    args = parser.parse_args(argv)

    os.environ["VLM_CATALOG_KERNELS"] = "auto"
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint, model = build_model(Path(scratch), args.layers)
        warmup: set[Variant] = set()
        run: set[Variant] = set()
        phase = warmup
        prefill = PrefillOps()

        def record(launch: Launch) -> None:
            phase.add(variant(launch))
            prefill.launched(launch)

        with gpu_choices_on_cpu(args.flash), recorded_launches(record):
            engine = build_engine(checkpoint, model)
            phase = run
            prefill.wrap(model.language_model)
            steps = run_records(engine, Path(scratch), args.records, args.output_tokens)
    missing = sorted(run - warmup)
    print(f"warm-up: {len(warmup)} variants of {len({v[0] for v in warmup})} kernels "
          f"({engine.warmup_report.num_steps} steps); run: {len(run)} variants in {steps} steps, "
          f"{len(missing)} not in the warm-up")
    for item in missing:
        print("  " + describe(item, warmup))
    ops = prefill.report(args.layers)
    print(f"prefill-sized forwards: {ops['forwards']} of {ops['tokens_mean']:.0f} tokens on average, "
          f"{args.layers} layer(s): {ops['triton_launches']:.1f} Triton launches and {ops['torch_ops']:.1f} torch "
          f"ops each (commonest: {', '.join(f'{name} {count:g}' for name, count in ops['torch_ops_by_name'].items())})")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "warmup_steps": engine.warmup_report.num_steps, "run_steps": steps,
            "warmup": variants_by_kernel(warmup), "run": variants_by_kernel(run),
            "missing": [describe(item, warmup) for item in missing], "prefill_forward": ops}, indent=1))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
