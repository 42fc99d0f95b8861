"""The whole engine on the GPU code paths, run on CPU: every kernel through Triton (interpreter)
and the FlashAttention varlen calls through the CPU stand-in, against the engine on the torch
reference path. It exercises, end to end and with real step metadata, the paths that only a GPU
takes: prompts with and without a prefix-cache hit in one varlen call (packed contexts), chunked
prefill, the vision tower's varlen call, the MoE's expert sum inside the next norm, routing
and align in one launch for decode batches, and paged decode attention. It also takes the
census of a decode step's launches."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from tests.engine.conftest import conversation
from tests.kernels.device_waits import DeviceWaits
from tests.kernels.flash_fakes import FakeFlashVarlen
from tests.model.helpers import build_checkpoint
from vlm_catalog import LLM, SamplingParams
from vlm_catalog.model.tiny_checkpoint import build_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("triton_engine") / "tiny", build_tokenizer(1000), seed=5)


@pytest.fixture
def gpu_paths_on_cpu(triton_device, fake_flash, monkeypatch) -> FakeFlashVarlen:
    """The engine takes the GPU paths on CPU tensors: `auto` makes the CUDA choices (Triton,
    then FlashAttention where an op prefers it), every kernel runs interpreted, and the
    FlashAttention stand-in, which takes float32 so that the varlen paths run at all, is
    returned to count its calls."""
    if triton_device.type != "cpu":
        pytest.skip("runs the GPU paths on CPU tensors, which needs the Triton interpreter")
    monkeypatch.setenv("VLM_CATALOG_KERNELS", "auto")
    monkeypatch.setattr("kernels.dispatch.AUTO_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr("kernels.flash_varlen.FLASH_DTYPES", (torch.float32, torch.float16, torch.bfloat16))
    return fake_flash(FakeFlashVarlen())


def run(checkpoint, conversations, waves: int = 2, **options) -> list[tuple[list[int], str]]:
    """Greedy answers for `conversations` sent in `waves` (the later ones hit the prefix cache)."""
    llm = LLM(checkpoint, max_num_batched_tokens=128, enable_prefix_caching=True, **options)  # float32
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    size = -(-len(conversations) // waves)
    outputs = []
    for start in range(0, len(conversations), size):
        outputs += llm.chat(conversations[start:start + size], params)
    return [(output.token_ids, output.finish_reason) for output in outputs]


# Each variant costs 70-110 s in the interpreter. The default run takes two: the defaults, and
# the record engine of the GPU benchmark (`engine_w8a8_channel`: per-channel W8A8 experts over an
# FP8 cache) with async scheduling. `make test-slow` runs the block-scaled W8A8 engine
# (`engine_w8a8`) and each option alone, to tell which of a failing combination is at fault.
VARIANTS = {  # name -> (engine options, slow)
    "defaults": ({}, False),
    "per-channel FP8 weights, FP8 KV cache, async scheduling": (
        {"quantization": "fp8_w8a8_channel", "kv_cache_dtype": "fp8", "async_scheduling": True}, False),
    "FP8 weights and KV cache": ({"quantization": "fp8_w8a8", "kv_cache_dtype": "fp8"}, True),
    "FP8 KV cache": ({"kv_cache_dtype": "fp8"}, True),
    "FP8 weights": ({"quantization": "fp8_w8a8"}, True),
    "per-channel FP8 weights": ({"quantization": "fp8_w8a8_channel"}, True),
    "async scheduling": ({"async_scheduling": True}, True),
}


@pytest.mark.parametrize("variant", [pytest.param(name, marks=[pytest.mark.slow] if slow else [])
                                     for name, (_, slow) in VARIANTS.items()])
def test_engine_on_the_gpu_paths_answers_as_on_the_reference_path(checkpoint, gpu_paths_on_cpu, monkeypatch, variant):
    # exact greedy tokens: both paths compute in float32 (the kernels' float32 tolerance is 1e-4)
    kernel = gpu_paths_on_cpu
    taken = count_calls(monkeypatch)
    system = "You are a careful catalogue assistant. " * 2  # a shared prefix: later prompts hit the cache
    conversations = [conversation(index, images=index % 2, words=4 + 7 * (index % 3), system=system)
                     for index in range(4)]
    options, _ = VARIANTS[variant]
    on_gpu_paths = run(checkpoint, conversations, **options)
    calls_on_gpu_paths = len(kernel.calls)
    monkeypatch.setenv("VLM_CATALOG_KERNELS", "reference")
    assert on_gpu_paths == run(checkpoint, conversations, **options)
    causal = [call for call in kernel.calls if tuple(call["window_size"]) == (-1, 0)]
    bidirectional = [call for call in kernel.calls if tuple(call["window_size"]) == (-1, -1)]
    assert bidirectional, "the vision tower's varlen call"
    packed = [call for call in causal if call["num_keys"] > call["cu_seq_q"][-1]]  # more keys than queries
    assert packed, "chunks with a cached context over packed contexts"
    assert len(causal) > len(packed)  # whole prompts on their own k/v too
    assert len(kernel.calls) == calls_on_gpu_paths  # the reference path made no varlen call
    assert all(taken.values()), taken


def test_engine_with_kernels_turned_off_answers_as_on_the_reference_path(checkpoint, gpu_paths_on_cpu, monkeypatch):
    """VLM_CATALOG_KERNELS_OFF, the way out when one kernel fails on a GPU: the ops named take
    their references inside the GPU paths (the MoE's unsummed terms, the one-launch norm and
    routing, the fused decode write all give way), the rest stay on Triton, and the answers do
    not change."""
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF",
                       "fused_moe,route_topk_and_align,add_rms_norm_router,paged_decode_attention_with_kv_write")
    taken = count_calls(monkeypatch)
    conversations = [conversation(index, images=index % 2, words=5) for index in range(3)]
    with_kernels_off = run(checkpoint, conversations, waves=1)
    monkeypatch.setenv("VLM_CATALOG_KERNELS", "reference")
    assert with_kernels_off == run(checkpoint, conversations, waves=1)
    turned_off = ("fused MoE", "norm, router and routing in one launch", "paged decode", "expert sum in the norm")
    assert {label: taken[label] for label in turned_off} == dict.fromkeys(turned_off, 0)
    assert taken["q/k norm and MRoPE"] > 0


GPU_ONLY_PATHS = {  # label -> (module, Triton wrapper)
    "expert sum in the norm": ("kernels.rms_norm", "fused_sum_add_rms_norm_triton"),
    # decode batches: the post-attention norm, the router, the routing and the pairs' layout
    "norm, router and routing in one launch": ("kernels.norm_router", "add_rms_norm_route_triton"),
    "paged decode": ("kernels.paged_decode_attention", "paged_decode_attention_with_kv_write_triton"),
    "fused MoE": ("kernels.moe.fused_moe", "fused_moe_triton"),
    "q/k norm and MRoPE": ("kernels.rotary", "qk_norm_mrope_triton"),
}


def count_calls(monkeypatch) -> dict[str, int]:
    """Counts the calls of the Triton wrappers in GPU_ONLY_PATHS as the engine makes them."""
    import importlib

    taken = dict.fromkeys(GPU_ONLY_PATHS, 0)
    for label, (module_name, function_name) in GPU_ONLY_PATHS.items():
        module = importlib.import_module(module_name)
        original = getattr(module, function_name)

        def spy(*args, original=original, label=label, **kwargs):
            taken[label] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, function_name, spy)
    return taken


VIEW_AND_ALLOCATION_OPS = {  # aten ops that launch no kernel on a GPU
    "empty", "empty_like", "new_empty", "empty_strided", "view", "reshape", "_unsafe_view", "slice", "select",
    "split", "split_with_sizes", "unsqueeze", "squeeze", "transpose", "t", "expand", "as_strided", "alias",
    "detach", "unbind", "permute", "promote_types", "result_type",
}


class ComputeOps(TorchDispatchMode):
    """Counts the torch ops that would launch a kernel (views and allocations left out)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEW_AND_ALLOCATION_OPS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def test_a_decode_step_launches_seven_kernels_per_layer_and_never_syncs(checkpoint, gpu_paths_on_cpu, monkeypatch):
    """The decode step's census on the GPU paths: the embedding and the first layer's input norm,
    then per layer two cuBLAS linears (qkv, o: this checkpoint is float32; a 16-bit model's go
    to `skinny_linear`'s kernel at decode batches), paged decode with q/k norm and MRoPE and the
    cache write inside, the add-and-norm after attention with the router's logits, the routing
    and the pairs' layout (its last program), the two MoE GEMMs and the add-and-norm after the MoE, which sums its terms (the next
    layer's input norm or the final norm). Nothing reads a device value on the host (a sync that CUDA-graph capture
    refuses). A new launch in the step must be added here on purpose; with
    VLM_CATALOG_KERNELS_OFF=decode_qk_norm_rope, q/k norm and MRoPE take their own launch again."""
    from triton.runtime.interpreter import InterpretedFunction

    llm = LLM(checkpoint, max_num_batched_tokens=128)
    model = llm.engine.runner.model
    layers = model.config.text.num_layers

    steps: list[tuple[int, collections.Counter, collections.Counter]] = []  # (tokens, Triton launches, torch ops)
    launches: collections.Counter[str] = collections.Counter()
    interpreted_run = InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        with _disable_current_modes():  # the interpreter's own tensor work is not the model's
            return interpreted_run(self, *args, **kwargs)

    model_forward = type(model).forward

    def counted_forward(self, input_ids, *args, **kwargs):
        launches.clear()
        with ComputeOps() as ops:
            hidden = model_forward(self, input_ids, *args, **kwargs)
        steps.append((input_ids.shape[0], launches.copy(), ops.counts))
        return hidden

    monkeypatch.setattr(InterpretedFunction, "run", counted_run)
    monkeypatch.setattr(type(model), "forward", counted_forward)
    conversations = [conversation(index, images=0, words=5) for index in range(2)]
    llm.chat(conversations, SamplingParams(max_tokens=4, ignore_eos=True))

    decode_steps = [step for step in steps if step[0] == len(conversations)]
    assert len(decode_steps) == 3  # tokens 2 to 4 of both answers
    for _, triton_launches, torch_ops in decode_steps:
        assert triton_launches == {
            "rms_norm_kernel": layers + 1,
            "add_rms_norm_router_kernel": layers,
            "paged_decode_split_kernel": layers,  # short contexts: one split, no merge launch
            "moe_gate_up_silu_kernel": layers,
            "moe_down_kernel": layers,
        }
        assert torch_ops == {"linear": 2 * layers, "embedding": 1}
    host_reads = {"_local_scalar_dense", "item", "nonzero"}
    assert not any(host_reads & set(torch_ops) for _, _, torch_ops in steps)  # prefill steps too
    prefill_steps = [launches for tokens, launches, _ in steps if tokens != len(conversations)]
    assert prefill_steps and all(launches["qk_norm_mrope_kernel"] == layers for launches in prefill_steps)

    steps.clear()  # the fusion turned off: q/k norm and MRoPE launch on their own in decode steps too
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "decode_qk_norm_rope")
    llm.chat(conversations, SamplingParams(max_tokens=2, ignore_eos=True))
    unfused = [launches for tokens, launches, _ in steps if tokens == len(conversations)]
    assert unfused and all(launches["qk_norm_mrope_kernel"] == layers for launches in unfused)


def test_steps_with_new_images_never_make_the_host_wait(checkpoint, gpu_paths_on_cpu, monkeypatch):
    """The vision tower and the text forward of eager steps, as the record engine of the GPU
    benchmark runs them (per-channel W8A8, FP8 cache, async scheduling; chunked prompts over
    cached contexts, decodes beside prefill chunks, images of grid shapes not seen before), do
    nothing that waits for the device: the host must run ahead to keep it busy. On CPU this
    reads the ops that would wait on CUDA (`DeviceWaits`); tests/engine/test_host_syncs.py checks
    the same on a GPU under CUDA's sync debug mode. The first-call checks (the warm-up's, on a
    GPU) run in a first, unaudited batch."""
    from triton.runtime.interpreter import InterpretedFunction

    from tests.model.helpers import noise_image

    llm = LLM(checkpoint, max_num_batched_tokens=48, quantization="fp8_w8a8_channel", kv_cache_dtype="fp8",
              async_scheduling=True)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.chat([conversation(index, images=1, words=6) for index in range(2)], params)  # first-call checks

    model = llm.engine.runner.model
    waits: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    interpreted_run = InterpretedFunction.run

    def unaudited_run(self, *args, **kwargs):
        with _disable_current_modes():  # the interpreter's own tensor work is not the model's
            return interpreted_run(self, *args, **kwargs)

    def audited(name):
        method = getattr(type(model), name)

        def run(self, *args, **kwargs):
            calls[name] += 1
            with DeviceWaits() as mode:
                result = method(self, *args, **kwargs)
            waits.update({f"{name}: {op}": count for op, count in mode.waits.items()})
            return result

        monkeypatch.setattr(type(model), name, run)

    monkeypatch.setattr(InterpretedFunction, "run", unaudited_run)
    for name in ("forward", "encode_images"):
        audited(name)
    new_shapes = [[{"role": "user", "content": [
        {"type": "image", "image": noise_image(64 + 29 * index, 96 - 17 * index, seed=index)},
        {"type": "text", "text": f"Item {index}: a plain cotton shirt, size M"}]}] for index in range(3)]
    answers = llm.chat(new_shapes, params)
    assert [len(answer.token_ids) for answer in answers] == [4] * 3
    assert calls["encode_images"] >= 1 and calls["forward"] > 3  # chunked prefill steps, then decodes
    assert llm.engine.runner.model.visual.grid_tables.misses >= 3  # every image a new grid shape
    assert not waits, waits


@pytest.mark.slow
def test_random_schedules_on_the_record_engine_s_paths_answer_as_the_reference_path_alone(
        checkpoint, gpu_paths_on_cpu, monkeypatch):
    """`tests/engine/test_random_schedules.py` on the GPU benchmark's record engine (per-channel
    W8A8 over an FP8 cache, async scheduling), every kernel through Triton: arrivals between
    steps, aborts, a pool that preempts, chunked prompts, shared images and prefixes, grammars and
    bad images. The state only these paths keep across steps (the decode kernel's cache write
    and in-place merge counters, the one-launch routing, the MoE's terms summed in the next norm)
    must not carry one request's schedule into another's answer: each answers as it does alone
    on the reference path. Seed 4's schedule holds five grammars, preemptions and aborts (about
    100 s in the interpreter); async steps keeping the rows of requests that took forced tokens
    meanwhile fail it."""
    from tests.engine.test_random_schedules import check_against_solo, run_random_schedule

    options = {"quantization": "fp8_w8a8_channel", "kv_cache_dtype": "fp8"}
    llm = LLM(checkpoint, async_scheduling=True, block_size=4, kv_cache_memory_bytes=40 * 1024,
              max_num_batched_tokens=64, max_num_seqs=6, **options)
    engine = llm.engine
    run = run_random_schedule(llm, seed=4, num_requests=(8, 9))
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    assert engine.stats.num_preemptions > 0 and run["aborted"] and engine.stats.num_grammars_attached > 0
    monkeypatch.setenv("VLM_CATALOG_KERNELS", "reference")
    solo = LLM(checkpoint, async_scheduling=False, **options)
    assert check_against_solo(run, solo, engine.num_blocks * engine.config.block_size) >= 3
