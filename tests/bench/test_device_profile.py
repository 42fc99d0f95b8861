"""device_profile: a torch.profiler trace summed by `vlm.*` region and kind of kernel.

On CPU the torch ops' own time stands in for kernels (the module docstring); the
region walk, the kinds and the busy union are the same code on CUDA."""

import time
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from vlm_catalog.bench.device_profile import UNMARKED, kernel_kind, profile_breakdown, union_seconds
from vlm_catalog.engine.device_timer import DeviceTimer


def event(name, device_type, start, end, id=0, linked=0, parent=None, annotation=False):
    """A stand-in for a torch.profiler event (times in microseconds)."""
    return SimpleNamespace(name=name, device_type=device_type, time_range=SimpleNamespace(start=start, end=end),
                           id=id, linked_correlation_id=linked, cpu_parent=parent, is_user_annotation=annotation)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("paged_decode_split_kernel", "attention"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "attention"),
        ("moe_gate_up_silu_kernel", "moe"),
        ("route_topk_align_kernel", "moe"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "gemm"),
        ("aten::addmm", "gemm"),
        ("rms_norm_kernel", "norm_rotary"),
        ("qk_norm_mrope_kernel", "norm_rotary"),
        ("quantize_activations_kernel", "quantize"),
        ("Memcpy HtoD (Pinned -> Device)", "copy"),
        ("silu_and_mul_kernel", "other"),
    ],
)
def test_kernels_sort_into_kinds_by_name(name, kind):
    assert kernel_kind(name) == kind


def test_the_union_of_intervals_counts_overlaps_once():
    assert union_seconds([]) == 0.0
    assert union_seconds([(5.0, 7.0), (0.0, 2.0), (1.0, 3.0), (2.5, 2.6), (6.0, 9.0)]) == pytest.approx(7.0)


def test_ops_are_charged_to_their_innermost_mark():
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    timer = DeviceTimer(torch.device("cpu"), "vlm.text_forward.decode")
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        with record_function("vlm.step"):
            torch.relu(a)  # the step's own op
            with timer:  # a labelled timer marks its calls
                for _ in range(3):
                    a @ b
        torch.sigmoid(b)  # outside every mark
        time.sleep(0.05)  # the host idles: nothing runs
    breakdown = profile_breakdown(profiler, on_cuda=False, wall_seconds=0.5)
    regions = breakdown["regions"]
    assert set(regions) == {"vlm.text_forward.decode", "vlm.step", UNMARKED}
    forward = regions["vlm.text_forward.decode"]
    assert forward["kinds"]["gemm"] > 0.9 * forward["seconds"] > 0  # beside them: aten::resolve_conj
    assert {row["name"] for row in forward["top"]} >= {"aten::mm"}
    assert [row["calls"] for row in forward["top"] if row["name"] == "aten::mm"] == [3]
    assert "gemm" not in regions["vlm.step"]["kinds"] and regions["vlm.step"]["kinds"]["other"] > 0
    assert "gemm" not in regions[UNMARKED]["kinds"]
    assert breakdown["kernel_seconds"] == pytest.approx(sum(region["seconds"] for region in regions.values()))
    # nested ops overlap in time: the union is at most their sum, and far below the idle wall time
    assert 0 < breakdown["busy_seconds"] <= breakdown["kernel_seconds"] + 1e-9
    assert breakdown["busy_fraction"] == pytest.approx(breakdown["busy_seconds"] / 0.5)
    assert timer.seconds > 0  # the timer still times


def test_on_cuda_kernels_count_and_the_marks_device_ranges_do_not():
    """The CUDA branch on stand-in events shaped as torch's: each kernel carries the id of the host
    event it was launched under (`linked_correlation_id`), and kineto also draws each mark on the
    device's timeline, a range spanning its kernels and the gaps between them, which is neither a
    kernel nor busy time. A kernel linked to no host event (Triton's, a CUDA graph's replay, on the
    H200 of 2026-11-27) goes to the innermost device-side mark around it, else to `unmarked`."""
    step = event("vlm.step", DeviceType.CPU, 0, 400, id=1)
    mark = event("vlm.text_forward.decode", DeviceType.CPU, 0, 100, id=2, parent=step)
    matmul = event("aten::mm", DeviceType.CPU, 10, 20, id=3, parent=mark)
    launch = event("cudaLaunchKernel", DeviceType.CPU, 11, 12, id=9, linked=3, parent=matmul)  # not a host op
    device = [event("paged_decode_split_kernel", DeviceType.CUDA, 0, 30, linked=2),
              event("sm90_xmma_gemm_bf16", DeviceType.CUDA, 40, 90, linked=3),
              event("fused_moe_kernel", DeviceType.CUDA, 100, 160),  # unlinked, inside the forward's range
              event("sampling_kernel", DeviceType.CUDA, 300, 310),  # unlinked, inside the step's range only
              event("stray_kernel", DeviceType.CUDA, 500, 505),  # unlinked, outside every mark
              event("vlm.step", DeviceType.CUDA, 0, 400, annotation=True),
              event("vlm.text_forward.decode", DeviceType.CUDA, 0, 200, annotation=True)]
    profiler = SimpleNamespace(events=lambda: [step, mark, matmul, launch, *device])
    breakdown = profile_breakdown(profiler, on_cuda=True, wall_seconds=1000e-6)
    regions = breakdown["regions"]
    assert regions["vlm.text_forward.decode"]["kinds"] == {
        "gemm": pytest.approx(50e-6), "moe": pytest.approx(60e-6), "attention": pytest.approx(30e-6)}
    assert regions["vlm.step"]["kinds"] == {"other": pytest.approx(10e-6)}
    assert regions[UNMARKED]["kinds"] == {"other": pytest.approx(5e-6)}
    assert breakdown["unlinked_kernel_seconds"] == pytest.approx(75e-6)
    assert breakdown["kernel_seconds"] == pytest.approx(155e-6)
    assert breakdown["busy_seconds"] == pytest.approx(155e-6) and breakdown["busy_fraction"] == pytest.approx(0.155)


def as_torch_2_11(events: list) -> SimpleNamespace:
    """A stand-in profiler whose events lack `linked_correlation_id`, as torch before 2.13 gives them;
    the links are in its raw kineto events (which start 1 ms into the trace)."""
    raw = [SimpleNamespace(device_type=lambda e=e: e.device_type, correlation_id=lambda e=e: e.id,
                           start_ns=lambda e=e: 1_000_000 + int(e.time_range.start * 1000),
                           linked_correlation_id=lambda e=e: e.linked_correlation_id) for e in events]
    bare = [SimpleNamespace(**{k: v for k, v in vars(e).items() if k != "linked_correlation_id"}) for e in events]
    results = SimpleNamespace(trace_start_ns=lambda: 1_000_000, events=lambda: raw)
    return SimpleNamespace(events=lambda: bare, profiler=SimpleNamespace(kineto_results=results))


def test_kernels_find_their_host_op_on_torch_2_11_too():
    """torch 2.11 (the GPU image's) leaves `linked_correlation_id` off its events: every kernel was
    charged as unlinked, and no wait named the host op it waited for (the H100 record of
    2026-11-28: unlinked_kernel_seconds equal to kernel_seconds). The links come from its raw
    kineto events."""
    step = event("vlm.step", DeviceType.CPU, 0, 400, id=1)
    mark = event("vlm.text_forward.prefill", DeviceType.CPU, 0, 100, id=2, parent=step)
    cat = event("aten::cat", DeviceType.CPU, 10, 20, id=3, parent=mark)
    launch = event("cudaLaunchKernel", DeviceType.CPU, 11, 12, id=3, linked=3, parent=cat)  # same id as the op
    device = [event("rms_norm_kernel", DeviceType.CUDA, 0, 30, id=7, linked=2),
              event("CatArrayBatchedCopy", DeviceType.CUDA, 52, 90, id=8, linked=3),
              event("vlm.step", DeviceType.CUDA, 0, 400, annotation=True)]
    events = [step, mark, cat, launch, *device]
    linked = profile_breakdown(SimpleNamespace(events=lambda: events), on_cuda=True, wall_seconds=1000e-6)
    bare = profile_breakdown(as_torch_2_11(events), on_cuda=True, wall_seconds=1000e-6)
    assert bare["unlinked_kernel_seconds"] == linked["unlinked_kernel_seconds"] == 0
    assert bare["regions"] == linked["regions"]
    waits = bare["regions"]["vlm.step"]["waits"]
    assert [(w["before"], w["launched_by"], w["after"]) for w in waits] == [
        ("rms_norm_kernel", "aten::cat", "CatArrayBatchedCopy")]


def test_on_cuda_the_device_s_idle_time_is_charged_to_the_mark_around_it_and_long_waits_are_named():
    """Each stretch with no kernel running is charged to the innermost device-side mark around it
    (split at the marks' edges; outside every mark: unmarked). Gaps of WAIT_MIN_MICROS and more
    are also summed by the kernel before and the host op that launched the kernel after; a short
    gap (kernels queued in time) counts as idle but is no wait. Kernels that overlap leave no gap."""
    step = event("vlm.step", DeviceType.CPU, 0, 400, id=1)
    mark = event("vlm.text_forward.prefill", DeviceType.CPU, 0, 100, id=2, parent=step)
    cat = event("aten::cat", DeviceType.CPU, 10, 20, id=3, parent=mark)
    device = [event("rms_norm_kernel", DeviceType.CUDA, 0, 30, linked=2),
              event("quantize_activations_kernel", DeviceType.CUDA, 20, 32),  # overlaps the norm
              event("CatArrayBatchedCopy", DeviceType.CUDA, 52, 90, linked=3),  # 20 us after the quantize
              event("fused_moe_kernel", DeviceType.CUDA, 94, 160),  # 4 us: idle, but no wait
              event("sampling_kernel", DeviceType.CUDA, 300, 310),
              event("stray_kernel", DeviceType.CUDA, 500, 505),
              event("vlm.step", DeviceType.CUDA, 0, 400, annotation=True),
              event("vlm.text_forward.prefill", DeviceType.CUDA, 0, 200, annotation=True)]
    profiler = SimpleNamespace(events=lambda: [step, mark, cat, *device])
    regions = profile_breakdown(profiler, on_cuda=True, wall_seconds=1000e-6)["regions"]
    forward, outer, unmarked = regions["vlm.text_forward.prefill"], regions["vlm.step"], regions[UNMARKED]
    assert forward["idle_seconds"] == pytest.approx((20 + 4 + 40) * 1e-6)  # the gap 160-300 up to the mark's end
    assert outer["idle_seconds"] == pytest.approx((100 + 90) * 1e-6)
    assert unmarked["idle_seconds"] == pytest.approx(100e-6)

    def waits(region):
        return [(w["before"], w["launched_by"], w["after"], round(w["seconds"] * 1e6), w["count"]) for w in region["waits"]]

    assert waits(forward) == [("fused_moe_kernel", None, "sampling_kernel", 40, 1),
                              ("quantize_activations_kernel", "aten::cat", "CatArrayBatchedCopy", 20, 1)]
    assert waits(outer) == [("fused_moe_kernel", None, "sampling_kernel", 100, 1),
                            ("sampling_kernel", None, "stray_kernel", 90, 1)]
    assert waits(unmarked) == [("sampling_kernel", None, "stray_kernel", 100, 1)]


def test_a_profiled_call_returns_its_result_and_where_its_time_went(monkeypatch):
    from vlm_catalog.bench import device_profile

    a = torch.randn(64, 64)
    result, breakdown = device_profile.profiled_call(lambda: (a @ a).sum().item(), torch.device("cpu"))
    assert result == pytest.approx(float((a @ a).sum()))
    assert breakdown["kernel_seconds"] > 0 and breakdown["analysis_seconds"] >= 0

    def refuse(**kwargs):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    monkeypatch.setattr("torch.profiler.profile", refuse)  # the profiler cannot start: the call runs unprofiled
    calls = []
    result, breakdown = device_profile.profiled_call(lambda: calls.append(1) or 7, torch.device("cpu"))
    assert result == 7 and calls == [1] and breakdown == {"error": "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"}
    monkeypatch.undo()

    def failing():
        raise ValueError("the engine's own error")

    with pytest.raises(ValueError, match="own error"):  # not the profiler's: raised, not run again
        device_profile.profiled_call(failing, torch.device("cpu"))
