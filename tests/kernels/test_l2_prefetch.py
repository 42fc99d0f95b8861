"""The weights a kernel asks for into L2 before it waits for the grid before it (PREFETCH_WEIGHT,
kernels/jit/l2_prefetch.py): every address it prefetches lies in its weights, every line of them
is asked for, and the kernel computes the same bits with the prefetches as without.

The interpreter runs no PTX, so `prefetch_to_l2` is replaced by a function that records the
addresses each program passes it. On the GPU, `test_gpu_weights_prefetched_before_the_wait_give_the_same_bits`
(below, `pytest -m gpu`) runs the kernels with programmatic dependent launch in a CUDA graph."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from kernels.jit import l2_prefetch
from kernels.jit.interpreter_compat import interpreter_enabled
from kernels.pdl import L2_LINE_BYTES, programmatic_dependent_launch
from kernels.skinny_linear import skinny_linear_triton
from tests.kernels.test_norm_router import inputs as norm_router_inputs
from tests.kernels.test_skinny_linear import operands as skinny_operands

norm_router_module = importlib.import_module("kernels.norm_router")
pdl_module = importlib.import_module("kernels.pdl")


@pytest.fixture
def prefetched(monkeypatch):
    """A function giving every address prefetched so far (uint64), recorded in place of the PTX."""
    if not interpreter_enabled():  # compiled for a GPU, the prefetch is PTX: nothing to record
        pytest.skip("records prefetched addresses under the Triton interpreter only")
    seen: list[np.ndarray] = []

    def record(pointers):
        seen.append(np.asarray(pointers.handle.data, dtype=np.uint64).ravel().copy())

    monkeypatch.setattr(l2_prefetch, "prefetch_to_l2", record)
    return lambda: np.concatenate(seen) if seen else np.empty(0, dtype=np.uint64)


def byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def lines_of(*tensors: torch.Tensor) -> set[int]:
    """The L2 lines (address // 128) holding any byte of `tensors`."""
    lines = set()
    for tensor in tensors:
        start, end = byte_range(tensor)
        lines.update(range(start // L2_LINE_BYTES, (end - 1) // L2_LINE_BYTES + 1))
    return lines


def assert_prefetched_exactly(addresses: np.ndarray, *tensors: torch.Tensor) -> None:
    """Every address inside one of `tensors`, and every line of them asked for."""
    inside = np.zeros(addresses.shape, dtype=bool)
    for tensor in tensors:
        start, end = byte_range(tensor)
        inside |= (addresses >= start) & (addresses < end)
    assert inside.all(), f"{int((~inside).sum())} prefetched addresses outside the weights"
    assert {int(address) // L2_LINE_BYTES for address in addresses} == lines_of(*tensors)


@pytest.mark.parametrize("rows,reduction,cols,dtype,launch", [
    (1, 2048, 640, torch.bfloat16, None),  # rows of 4 KiB, each on a line; 40 programs
    (3, 200, 70, torch.float16, None),  # rows of 400 bytes, across lines; the last program past N
    (2, 300, 100, torch.bfloat16, dict(BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3)),
], ids=["30B-width", "odd-sizes", "other-launch"])
def test_the_skinny_projection_prefetches_its_weight_and_computes_the_same(
        triton_device, prefetched, rows, reduction, cols, dtype, launch):
    x, weight, bias = skinny_operands(rows, reduction, cols, dtype, True, triton_device)
    plain = skinny_linear_triton(x, weight, bias, launch=launch, prefetch_weight=False)
    assert prefetched().size == 0
    ahead = skinny_linear_triton(x, weight, bias, launch=launch, prefetch_weight=True)
    assert torch.equal(ahead, plain)
    assert_prefetched_exactly(prefetched(), weight)


@pytest.mark.parametrize("num_tokens,hidden_size,num_experts,dtype", [
    (1, 2048, 128, torch.bfloat16),  # the 30B-A3B router at batch 1: 64 programs of 2 experts
    (3, 200, 60, torch.float32),  # rows of 800 bytes, across lines; E not a multiple of the programs'
], ids=["30B-width", "odd-sizes"])
@pytest.mark.parametrize("route", [False, True], ids=["logits", "routed"])
def test_the_norm_and_router_launch_prefetches_its_weights_and_computes_the_same(
        triton_device, prefetched, monkeypatch, num_tokens, hidden_size, num_experts, dtype, route):
    x, residual, norm_weight, gate_weight = norm_router_inputs(num_tokens, hidden_size, num_experts, dtype,
                                                               triton_device)

    def launch():
        if route:
            normed, new_residual, routing = norm_router_module.add_rms_norm_route_triton(
                x, residual, norm_weight, 1e-6, gate_weight, 4, True, torch.float32, 16)
            return (normed, new_residual, routing.weights, routing.ids, routing.alignment.sorted_token_ids,
                    routing.alignment.expert_ids, routing.alignment.num_tokens_post_padded)
        return norm_router_module.add_rms_norm_router_triton(x, residual, norm_weight, 1e-6, gate_weight)

    monkeypatch.setattr(pdl_module, "prefetches_weights", lambda options: False)
    plain = launch()
    assert prefetched().size == 0
    monkeypatch.setattr(pdl_module, "prefetches_weights", lambda options: True)  # as under PDL
    ahead = launch()
    for got, want in zip(ahead, plain, strict=True):
        assert torch.equal(got, want)
    assert_prefetched_exactly(prefetched(), gate_weight, norm_weight)


def test_rows_off_the_lines_are_prefetched_to_their_last_line(triton_device, prefetched):
    """A weight whose rows start inside a line and whose columns fill the walk's steps exactly
    (512 bfloat16 columns: one step of 8 lines) spans 9 lines a row: the walk goes one line past
    its last column to reach the ninth."""
    x = torch.randn(1, 512, device=triton_device).to(torch.bfloat16)
    rows = torch.randn(16, 520, device=triton_device).to(torch.bfloat16)
    weight = rows[:, 4:516]  # [16, 512], rows 1040 bytes apart, the first 8 bytes into a line
    out = skinny_linear_triton(x, weight, prefetch_weight=True)
    assert torch.equal(out, skinny_linear_triton(x, weight, prefetch_weight=False))
    addresses = prefetched()
    for row in weight:  # every line of every row, and nothing outside them
        start, end = byte_range(row)
        inside = addresses[(addresses >= start) & (addresses < end)]
        assert {int(a) // L2_LINE_BYTES for a in inside} == lines_of(row)
    assert_prefetched_exactly(addresses, *weight)


def test_a_program_asks_for_each_line_once_on_aligned_rows(triton_device, prefetched):
    """At the 30B width (rows of whole lines) the walk's one step past the last column adds no
    line: 2048 columns of bfloat16 are 32 lines a row, and a program of 16 rows asks for 16 x 32
    of them, plus at most one repeat of each row's last."""
    x, unaligned, _ = skinny_operands(1, 2048, 16, torch.bfloat16, False, triton_device)
    buffer = torch.empty(unaligned.numel() + L2_LINE_BYTES, dtype=torch.bfloat16, device=triton_device)
    skip = (-buffer.data_ptr() % L2_LINE_BYTES) // 2  # elements to the next line (CPU memory is 64-byte aligned)
    weight = buffer[skip:skip + unaligned.numel()].view(16, 2048).copy_(unaligned)
    assert weight.data_ptr() % L2_LINE_BYTES == 0
    skinny_linear_triton(x, weight, prefetch_weight=True)
    addresses = prefetched()
    assert len({int(a) // L2_LINE_BYTES for a in addresses}) == 16 * 32
    assert addresses.size <= 16 * 32 + 16 * 8  # a last step of 8 lines a row, all clamped to the last


@pytest.mark.gpu
@pytest.mark.fast_path("pdl_weight_prefetch")
def test_gpu_weights_prefetched_before_the_wait_give_the_same_bits(cuda_device):
    """With programmatic dependent launch, each kernel launched while the one before still writes
    its input, in a CUDA graph replayed 20 times: the skinny projection (q/k/v at 30B-A3B) and the
    norm-and-router launch give the bits of their launches without prefetching."""
    if torch.cuda.get_device_capability(cuda_device) < (9, 0):
        pytest.skip("programmatic dependent launch needs a Hopper GPU")
    torch.manual_seed(0)
    device = cuda_device
    x, weight, _ = skinny_operands(1, 2048, 5120, torch.bfloat16, False, device)
    h, residual, norm_weight, gate_weight = norm_router_inputs(1, 2048, 128, torch.bfloat16, device)

    def chain(prefetch: bool):
        doubled = x * 2  # a torch kernel writing the projection's input just before it
        projected = skinny_linear_triton(doubled, weight, prefetch_weight=prefetch)
        norm_router_module._launch(h + projected[:, :2048], residual, norm_weight, 1e-6, gate_weight, *outputs,
                                   prefetch_weight=prefetch)
        return projected

    outputs = (torch.empty(1, 2048, device=device, dtype=torch.bfloat16),
               torch.empty(1, 2048, device=device, dtype=torch.bfloat16),
               torch.empty(1, 128, device=device, dtype=torch.bfloat16))
    with programmatic_dependent_launch(True):
        plain = chain(False).clone()
        plain_outputs = [tensor.clone() for tensor in outputs]
        chain(True)  # compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = chain(True)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, plain)
        for got, want in zip(outputs, plain_outputs, strict=True):
            assert torch.equal(got, want)
