"""Zeroed int32 counters per device, for kernels whose last program to finish does a final step.

A kernel that splits work over programs and needs one more step over all of their results
(merging a split decode's partials, routing on a whole row of router logits) would take a
second launch. Instead each program counts its arrival with an atomic add (release-acquire at
GPU scope, after a CTA barrier), and the one that brings the count to the number of programs
does the step and puts its counter back to zero: the pattern of CUTLASS's split-K semaphores.
The paged decode kernel (`MERGE_IN_PLACE`) and the norm-and-router kernel (`ROUTE`) use these.

One buffer per device, allocated on the first eager call: a buffer allocated inside a CUDA-graph
capture would belong to the graph's pool, so there `arrival_counters` returns None and the
caller takes its two-launch path (the engine's graphs run each batch eagerly before capturing
it). Every launch leaves the counters at zero. Launches on one device share them, so two such
launches must not overlap (one stream, as the engine runs them).

The pattern leans on how the compiler lowers one program's atomic and on the GPU's memory
model, which the interpreter cannot show. So the engine checks both kernels once per device
when it starts (`check_last_program_kernels`), against their two-launch paths on small inputs,
a few launches each. A mismatch or an error logs a warning, and on that device the counters are
not served any more: both kernels take their two launches, slower but right (the way a
faster path that fails its check keeps the old code, kernels/first_call_check.py).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

ARRIVAL_COUNTERS = 1 << 16  # counters per device: 256 KiB
CHECK_LAUNCHES = 3  # launches of each kernel in the start-up check: each must give the same bits
CHECK_TOLERANCE = 1e-2  # of max |two-launch result|: the merge's float32 sums in another order
_counters: dict[tuple[str, int | None], torch.Tensor] = {}
_trusted: dict[tuple[str, int | None], bool] = {}  # the start-up check's verdict per device


def _device_key(device: torch.device) -> tuple[str, int | None]:
    return (device.type, device.index if device.type != "cuda" or device.index is not None
            else torch.cuda.current_device())


def arrival_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """The device's zeroed counters, or None where they cannot serve: more than the buffer holds
    (`ARRIVAL_COUNTERS` when it was made), a capture before the first eager call, or a device
    where `check_last_program_kernels` found the kernels that use them wrong."""
    key = _device_key(device)
    if _trusted.get(key) is False:
        return None
    counters = _counters.get(key)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _counters[key] = torch.zeros(ARRIVAL_COUNTERS, dtype=torch.int32, device=device)
    return counters if needed <= counters.numel() else None


def check_last_program_kernels(device: torch.device) -> bool:
    """Whether the kernels whose last program finishes the work may use the counters on `device`
    (checked once per device; the module docstring): the split decode's in-place merge against
    its reduce launch, and the norm-and-router launch's routing against the routing kernel on
    the same logits. Each runs CHECK_LAUNCHES times and must give the same bits every time.
    Where Triton does not run these ops on `device` (the CPU engine) there is nothing to check;
    the counters are made either way, so no step allocates them."""
    from kernels.dispatch import use_triton

    key = _device_key(device)
    arrival_counters(device, 0)
    if key in _trusted:
        return _trusted[key]
    probe = torch.empty(0, device=device)
    checks = [check for op, check in (("paged_decode_attention", _merge_problem),
                                      ("add_rms_norm_router", _routing_problem)) if use_triton(probe, op=op)]
    if not checks:
        return True
    _trusted[key] = True  # while they are checked, the kernels take the counters
    try:
        problem = next((found for found in (check(device) for check in checks) if found), None)
    except Exception as exc:  # noqa: BLE001 - any failure (a compile error, a crash) keeps the two launches
        problem = f"{type(exc).__name__}: {exc}"
    if problem is not None:
        logger.warning("kernels finishing in their last program (kernels/arrival_counters.py) failed their check "
                       "on %s: %s; the split decode keeps its reduce launch and the routing its own launch there",
                       device, problem)
    _trusted[key] = problem is None
    return _trusted[key]


def trust_without_checking(device: torch.device) -> None:
    """Let `device` keep its counters without `check_last_program_kernels` running there: for a
    caller whose kernel launches do nothing (bench_step_overhead.py --gpu-paths counts them), where
    the check would compare empty outputs."""
    _trusted[_device_key(device)] = True


def _random_inputs(device: torch.device):
    """A function making seeded normal tensors on `device`, in bf16 on CUDA and in float32 under
    the interpreter; and that dtype."""
    generator = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    return random, dtype


def _merge_problem(device: torch.device) -> str | None:
    """What is wrong with the split decode's in-place merge on `device`, or None."""
    from kernels.dispatch import KERNELS_OFF_ENV_VAR, environment_variable, kernels_off
    from kernels.paged_decode_attention import paged_decode_attention_triton

    random, _ = _random_inputs(device)
    # one sequence over several splits (merged in place), two that one split holds
    lengths, block_size, kv_heads, group, head_dim, splits = (600, 130, 5), 16, 2, 2, 32, 4
    blocks_per_sequence = -(-max(lengths) // block_size)
    num_blocks = len(lengths) * blocks_per_sequence
    k_cache, v_cache = (random(num_blocks, block_size, kv_heads, head_dim) for _ in range(2))
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))
    block_tables = order.view(len(lengths), blocks_per_sequence).to(device, torch.int32)  # [B, blocks per sequence]
    args = (random(len(lengths), kv_heads * group, head_dim), k_cache, v_cache, block_tables,
            torch.tensor(lengths, dtype=torch.int32, device=device), head_dim**-0.5)
    merged = [paged_decode_attention_triton(*args, max_context_len=max(lengths), num_splits=splits)
              for _ in range(CHECK_LAUNCHES)]
    with environment_variable(KERNELS_OFF_ENV_VAR, ",".join(sorted(kernels_off() | {"decode_merge_in_place"}))):
        reduced = paged_decode_attention_triton(*args, max_context_len=max(lengths), num_splits=splits)
    return _differences("the in-place merge", merged, reduced)


def _routing_problem(device: torch.device) -> str | None:
    """What is wrong with the norm-and-router launch's routing on `device`, or None: its top-k
    and layout against the routing kernel's on the logits the same kernel stores without it."""
    from kernels.moe.routing import route_topk_and_align_triton
    from kernels.norm_router import add_rms_norm_route_triton, add_rms_norm_router_triton

    random, dtype = _random_inputs(device)
    tokens, hidden, experts, top_k, block_size = 4, 64, 16, 4, 4
    args = (random(tokens, hidden), random(tokens, hidden), random(hidden), 1e-6, random(experts, hidden))
    _, _, logits = add_rms_norm_router_triton(*args)
    weights, ids, alignment = route_topk_and_align_triton(logits, top_k, True, dtype, block_size)
    used = int(alignment.num_tokens_post_padded)
    for launch in range(1, CHECK_LAUNCHES + 1):
        _, _, routing = add_rms_norm_route_triton(*args, top_k, True, dtype, block_size)
        got = routing.alignment
        if got is None:
            return "the routing took its two-launch path while checked"
        # the ids exactly; the weights to a step of their dtype: the two kernels sum the softmax over
        # other thread layouts (a row per program against two rows per warp), so a float32 sum may
        # differ in its last bit and round a renormalised bf16 weight to the next value
        if not (torch.equal(routing.ids, ids) and torch.allclose(
                routing.weights.float(), weights.float(), rtol=torch.finfo(weights.dtype).eps, atol=0)):
            return f"launch {launch}: its top-k differs from the routing kernel's"
        if int(got.num_tokens_post_padded) != used or not (
                torch.equal(got.sorted_token_ids[:used], alignment.sorted_token_ids[:used])
                and torch.equal(got.expert_ids[:used // block_size], alignment.expert_ids[:used // block_size])):
            return f"launch {launch}: its layout of the pairs differs from the routing kernel's"
    return None


def _differences(what: str, launches: list[torch.Tensor], expected: torch.Tensor) -> str | None:
    """Why `launches` (the same call, repeated) are wrong against `expected`, or None."""
    if any(not torch.equal(launch, launches[0]) for launch in launches[1:]):
        return f"{what} gave different bits in {len(launches)} launches of the same call"
    scale = expected.float().abs().max().clamp_min(1e-30)
    error = float((launches[0].float() - expected.float()).abs().max() / scale)
    if not error <= CHECK_TOLERANCE:  # NaN fails too
        return f"{what} is {error:.3g} (of max |expected|) from the two-launch result, above {CHECK_TOLERANCE}"
    return None
