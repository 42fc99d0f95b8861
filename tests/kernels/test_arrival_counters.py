"""The start-up check of the kernels whose last program finishes the work
(kernels/arrival_counters.py): it passes where they are right, and where they are wrong (counters
that do not start at zero: the arrival is then never counted as the last, as a compiler that
made every thread add would do) it says so, and the device gets no counters any more, so the
decode merge and the routing take their two launches and stay right."""

from __future__ import annotations

import logging

import pytest
import torch

from kernels import arrival_counters as counters_module
from kernels.arrival_counters import arrival_counters, check_last_program_kernels
from tests.kernels.test_paged_decode_attention import ReduceSpy


@pytest.fixture
def fresh_verdicts(monkeypatch):
    """No verdict yet for any device, and the counters put back at zero afterwards."""
    monkeypatch.setattr(counters_module, "_trusted", {})
    yield
    for counters in counters_module._counters.values():
        counters.zero_()


def test_right_kernels_pass_and_keep_their_counters(triton_device, fresh_verdicts, caplog):
    with caplog.at_level(logging.WARNING, logger="kernels.arrival_counters"):
        assert check_last_program_kernels(triton_device)
    assert not caplog.records
    assert arrival_counters(triton_device, 1) is not None
    assert int(arrival_counters(triton_device, 1).abs().sum()) == 0  # every launch left them at zero
    assert check_last_program_kernels(triton_device)  # once per device: the verdict is kept


def test_counters_that_never_count_the_last_arrival_fail_the_check_and_are_withdrawn(
        triton_device, fresh_verdicts, caplog, monkeypatch):
    from kernels.jit import paged_decode_attention as jit
    from kernels.moe.routing import route_topk_and_align_triton
    from kernels.norm_router import add_rms_norm_route_triton, add_rms_norm_router_triton

    arrival_counters(triton_device, 1).fill_(5)  # no program ever arrives last
    with caplog.at_level(logging.WARNING, logger="kernels.arrival_counters"):
        assert not check_last_program_kernels(triton_device)
    (record,) = caplog.records
    assert "failed their check" in record.getMessage() and "in-place merge" in record.getMessage()
    assert arrival_counters(triton_device, 1) is None
    # the kernels still answer right, through their two launches
    reduce_launches = []
    monkeypatch.setattr(jit, "paged_decode_reduce_kernel", ReduceSpy(jit.paged_decode_reduce_kernel, reduce_launches))
    assert counters_module._merge_problem(triton_device) is None
    assert reduce_launches  # no merge in place: the reduce kernel ran
    generator = torch.Generator().manual_seed(1)
    args = [torch.randn(*shape, generator=generator).to(triton_device) for shape in ((3, 64), (3, 64), (64,))]
    gate = torch.randn(16, 64, generator=generator).to(triton_device)
    _, _, routing = add_rms_norm_route_triton(*args, 1e-6, gate, 4, True, torch.float32, 4)
    _, _, logits = add_rms_norm_router_triton(*args, 1e-6, gate)
    weights, ids, _ = route_topk_and_align_triton(logits, 4, True, torch.float32, 4)
    assert torch.equal(routing.ids, ids) and torch.equal(routing.weights, weights)


def test_a_check_that_raises_withdraws_the_counters(triton_device, fresh_verdicts, caplog, monkeypatch):
    def crash(device):
        raise RuntimeError("illegal instruction")

    monkeypatch.setattr(counters_module, "_merge_problem", crash)
    with caplog.at_level(logging.WARNING, logger="kernels.arrival_counters"):
        assert not check_last_program_kernels(triton_device)
    assert "RuntimeError: illegal instruction" in caplog.records[0].getMessage()
    assert arrival_counters(triton_device, 1) is None


def test_nothing_is_checked_where_the_torch_references_run(fresh_verdicts, monkeypatch):
    monkeypatch.setenv("VLM_CATALOG_KERNELS", "reference")
    monkeypatch.setattr(counters_module, "_merge_problem", lambda device: pytest.fail("checked"))
    assert check_last_program_kernels(torch.device("cpu"))
    assert arrival_counters(torch.device("cpu"), 1) is not None  # made anyway: no step allocates them


@pytest.mark.gpu
@pytest.mark.fast_path("decode_merge_in_place", "norm_router_routes")
def test_gpu_the_start_up_check_passes(cuda_device, fresh_verdicts, caplog):
    with caplog.at_level(logging.WARNING, logger="kernels.arrival_counters"):
        assert check_last_program_kernels(cuda_device), caplog.text
    assert arrival_counters(cuda_device, 1) is not None
