"""scripts/gpu_record_summary.py: a GPU record's numbers as the Markdown docs/benchmarks.md keeps,
on the H100 record of 2026-11-27, morning (fields it predates print "-"), on the current
committed record, and on one with every field the record plan now writes."""

from __future__ import annotations

import importlib.util
import json
import sys

from vlm_catalog.paths import REPO_ROOT

RESULTS = REPO_ROOT / "docs" / "results" / "gpu"
RECORD = RESULTS / "bench_gpu_h100_2026-11-27_morning.json"
CURRENT_RECORD = RESULTS / "bench_gpu.json"


def load_summary():
    spec = importlib.util.spec_from_file_location("gpu_record_summary", REPO_ROOT / "scripts" / "gpu_record_summary.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def engine_run(samples_per_s: float) -> dict:
    return {"samples_per_s": samples_per_s, "seconds": 256 / samples_per_s, "prefill_tokens_per_s": 40000.0,
            "decode_tokens_per_s": 9000.0, "model_steps": 179, "prefill_steps": 29,
            "host_forward_seconds": {"prefill_steps": 1.5, "decode_steps": 0.75},
            "device_seconds": {"vision_encoder": 4.5, "text_forward_prefill_steps": 7.25,
                               "text_forward_decode_steps": 3.5, "rest_of_steps": 0.5, "between_steps": 1.25},
            "host_seconds": {"scheduling": 0.5, "steps": 15.0, "outputs": 0.25, "working": 12.5,
                             "waiting_for_sampled_tokens": {"prefill_steps": 0.25, "decode_steps": 3.0}}}


NEW_RECORD = {
    "device": "NVIDIA H100 80GB HBM3", "date": "2026-11-28", "moe_gemm": "triton", "sdpa_backend": "default",
    "flash_varlen": "fa3_fwd_interface",
    "engine_w8a8_channel": {"fixed_150_tokens": engine_run(14.5), "fixed_150_tokens_again": [engine_run(15.5)],
                            "routing": {"layers": 48, "experts": 128, "top_k": 8, "uniform_top_k_share": 0.0625,
                                        "large_calls": {"calls": 3, "top_k_share": 0.15, "top_k_share_worst_layer": 0.25,
                                                        "max_over_mean_load": 3.25, "experts_unused": 0},
                                        "small_calls": {"calls": 2, "distinct_experts": 25.5,
                                                        "uniform_distinct_experts": 25.75,
                                                        "distinct_over_uniform": 0.99}}},
    "engine_w8a8_channel_grouped_mm": {"error": "RuntimeError: CUDA error: an illegal memory access"},
    "engine_profile": {"fixed_150_tokens": engine_run(11.0), "profile": {
        "time": "device kernels", "wall_seconds": 6.0, "busy_seconds": 4.5, "busy_fraction": 0.75,
        "kernel_seconds": 4.4, "unlinked_kernel_seconds": 2.25, "regions": {
            "vlm.text_forward.prefill": {"seconds": 3.0, "kinds": {"moe": 2.125, "gemm": 0.5, "attention": 0.375},
                                         "top": [{"name": "moe_gate_up_silu_kernel", "seconds": 1.5, "calls": 384}],
                                         "idle_seconds": 0.625, "waits": [
                                             {"before": "quantize_activations_kernel", "launched_by": "aten::cat",
                                              "after": "CatArrayBatchedCopy", "seconds": 0.25, "count": 240}]},
            "vlm.vision_encoder": {"seconds": 1.4, "kinds": {"attention": 0.875, "gemm": 0.525}, "top": []}}}},
    "constrained": {"constrained_over_unconstrained": 0.81, "grammar_compilations": 256,
                    "grammar_compile_seconds": 3.5,
                    "constrained_real_stop": dict(engine_run(9.0), grammar_wait_seconds_mean=0.125,
                                                  grammar_fill_seconds=1.75, grammar_advance_seconds=0.5,
                                                  logit_masking_seconds=0.25)},
    "constrained_w8a8_channel": {"constrained_over_unconstrained": 0.93, "kv_cache_tokens": 794256,
                                 "constrained_real_stop": engine_run(16.0), "constrained_again": engine_run(16.5),
                                 "constrained_again_over_unconstrained": 0.96,
                                 "other_jump_forward": {"jump_forward": True, "same_tokens": True,
                                                        "over_unconstrained": 1.04,
                                                        "run": dict(engine_run(17.5), jump_forward_tokens=5505)}},
    "roofline": {"prefill_tokens": 8192, "prefill_mfu": 0.52, "decode_batch1_seconds": 0.0042,
                 "decode_over_floor": 1.9, "decode_batch1_graph_seconds": 0.00395,
                 "decode_batch1_pdl": {"pdl": True, "seconds": 0.0036, "over_floor": 1.63, "kernels": {}},
                 "decode_batch1_pdl_without_prefetch": {"pdl": True, "kernels_off": ["pdl_weight_prefetch"],
                                                        "seconds": 0.0038, "over_floor": 1.72, "kernels": {}},
                 "decode_batch1_unfused": {"kernels_off": ["add_rms_norm_router", "decode_merge_in_place"],
                                           "seconds": 0.0046, "over_floor": 2.1, "kernels": {}},
                 "decode_batch1_kernels": {"total_us_per_step": 3900.0, "kernels": [
                     {"name": "moe_gate_up_silu_kernel", "us_per_step": 850.0, "calls_per_step": 48.0}]},
                 "decode_large_batch": {"batch": 256, "context": 256, "seconds": 0.021,
                                        "kernels": {"error": "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"}}},
    "kernels": {"rows": [
        {"name": "fused_moe[fp8 w8a8, per-channel, grouped_mm]", "shape": "T=16384", "triton_ms": 1.6,
         "baseline_ms": 2.4, "speedup": 1.5, "note": "sets VLM_CATALOG_MOE_GEMM's default"},
        {"name": "varlen_attention[triton, 128x64 tiles, 8 warps, 3 stages]", "shape": "1 images x 15625 patches",
         "triton_ms": 4.5, "baseline_ms": 5.4, "speedup": 1.2, "note": "sets varlen_tiles for long segments",
         "host_ms": 0.12},
        {"name": "moe_align_block_size", "shape": "T=16384", "triton_ms": 0.02, "baseline_ms": 0.5, "speedup": 25.0},
        {"name": "rms_norm", "shape": "T=4096 H=2048", "triton_ms": 0.02, "baseline_ms": 0.1, "speedup": 5.0}]},
}


def test_the_morning_record_prints_its_runs_and_targets():
    text = load_summary().summarize(json.loads(RECORD.read_text()))
    assert "| engine_w8a8_channel | 13.24 | 19.33 | 33,007 | 9,342 | 179 | 5.44 | - / - | - / - |" in text
    assert "constrained / unconstrained at equal tokens: 0.69x" in text
    assert "decode step at batch 1: 4.488 ms, 2.03x the floor" in text
    # the committed record predates host_ms: "-" in its column
    assert "| record | paged_decode_attention[fp8 kv] | B=32 ctx=2048 | 0.1724 | - | 0.0596 | 0.35 |" in text
    assert "rms_norm" not in text  # rows without a target or a switch to set are left out


def test_the_current_record_prints_its_profile_constrained_orders_and_vision():
    text = load_summary().summarize(json.loads(CURRENT_RECORD.read_text()))
    assert "| engine_w8a8_channel | 15.04 | 17.02 |" in text
    assert "| vlm.text_forward.prefill | 2.935 |" in text and "longest waits" not in text  # no idle fields yet
    assert ("constrained / unconstrained at equal tokens: 0.91x (target 0.95x); the constrained run again, "
            "after the unconstrained one: 0.95x") in text
    assert "145528 patches: 0.584 s, 64.5% MFU" in text
    assert "decode step at batch 1: 4.142 ms, 1.97x the floor" in text


def test_a_record_with_the_new_fields_prints_them_beside_the_previous_one(tmp_path, capsys):
    module = load_summary()
    (tmp_path / "new.json").write_text(json.dumps(NEW_RECORD))
    assert module.main([str(tmp_path / "new.json"), "--previous", str(RECORD)]) == 0
    text = capsys.readouterr().out
    assert "| engine_w8a8_channel | 14.50 (was 13.24) |" in text
    assert "sdpa_backend default; flash_varlen fa3_fwd_interface" in text
    assert "| 179 (29 prefill) | 4.50 | 7.25 / 3.50 | 0.50 / 1.25 | 1.50 / 0.75 |" in text  # the device-time split
    assert "| engine_w8a8_channel_grouped_mm | error: RuntimeError: CUDA error: an illegal memory access |" in text
    assert "busy 4.50 s of 6.00 s (75%), kernels 4.40 s (2.25 s of them linked to no host event" in text
    assert "| vlm.text_forward.prefill | 3.000 | 0.375 | 2.125 | 0.500 | - | - | - | - | 0.625 |" in text
    assert ("- 0.250 s, 240 gaps: `quantize_activations_kernel` -> aten::cat -> `CatArrayBatchedCopy`") in text
    assert "384 calls: `moe_gate_up_silu_kernel`" in text
    assert "0.81x (was 0.69x)" in text and "256 in 3.50 s" in text and "masks filled 1.75 s" in text
    assert ("- constrained_w8a8_channel (per-channel W8A8, FP8 KV cache, KV cache 794256 tokens): constrained / "
            "unconstrained at equal tokens: 0.93x (target 0.95x); the constrained run again, after the "
            "unconstrained one: 0.96x") in text
    assert "| engine_w8a8_channel (run 2) | 15.50 |" in text  # --repeat-runs: the later runs beside the first
    assert ("- engine_w8a8_channel: working 12.50 s (scheduling 0.50, steps 15.00 less their waits for sampled "
            "tokens, 0.25 in prefill and 3.00 in decode steps, outputs 0.25) against the device's 15.75 s in "
            "steps") in text
    assert ("- engine_w8a8_channel: the busiest 8 experts took 15% of the slots (25% at the worst layer; uniform 6%) "
            "in 3 prefill-sized calls, busiest / mean load 3.2, 0 layer-experts unused; decode-sized calls touched "
            "25.5 experts per layer (uniform 25.8)") in text
    assert "| constrained_w8a8_channel (constrained_again) | 16.50 |" in text
    assert "with jump-forward on: 17.50 samples/s, 1.04x unconstrained, " in text
    assert "(5505 tokens by jump-forward), the same tokens" in text
    assert "2.03x" in text and "1.90x the floor (was 2.03x) (target 1.5x); the graph alone 3.950 ms" in text
    assert "850.0 us x48: `moe_gate_up_silu_kernel`" in text
    assert "the same with programmatic dependent launch on: 3.600 ms, 1.63x the floor" in text
    assert ("the same with programmatic dependent launch and no weights prefetched before the wait: 3.800 ms, "
            "1.72x the floor") in text
    assert "the same with add_rms_norm_router, decode_merge_in_place off: 4.600 ms, 2.10x the floor" in text
    assert "decode_large_batch: error: RuntimeError: CUPTI_ERROR_NOT_INITIALIZED" in text
    assert "| record | fused_moe[fp8 w8a8, per-channel, grouped_mm] | T=16384 | 1.6000 | - | 2.4000 | 1.50 |" in text
    assert "| record | moe_align_block_size | T=16384 | 0.0200 | - | 0.5000 | 25.00 |" in text  # the prefill's layout
    assert ("| record | varlen_attention[triton, 128x64 tiles, 8 warps, 3 stages] | 1 images x 15625 patches "
            "| 4.5000 | 0.1200 | 5.4000 | 1.20 |") in text  # host_ms beside the device time
    assert "| rms_norm |" not in text  # the kernel table leaves it out (the roofline names add_rms_norm_router)


def test_the_sessions_other_files_get_rows_of_their_own(tmp_path, capsys):
    """Call 2 writes the same phase with other settings into other files: each gets its own row."""
    module = load_summary()
    paths = {}
    for name, rate in (("new.json", 14.5), ("engine_async.json", 15.25), ("engine_steps_32k.json", 15.75)):
        paths[name] = tmp_path / name
        paths[name].write_text(json.dumps({"engine_w8a8_channel": {"fixed_150_tokens": engine_run(rate)}}))
    assert module.main([str(paths["new.json"]), "--extra", str(paths["engine_async.json"]),
                        str(paths["engine_steps_32k.json"])]) == 0
    text = capsys.readouterr().out
    assert "| engine_w8a8_channel | 14.50 |" in text
    assert "| engine_w8a8_channel (engine_async.json) | 15.25 |" in text
    assert "| engine_w8a8_channel (engine_steps_32k.json) | 15.75 |" in text
    vision = {"images": 32, "patches": 145528, "seconds": 0.5, "mfu": 0.7}
    text = module.summarize(json.loads(RECORD.read_text()), extras=[("vision_cudnn.json", {"vision_encoder": vision})])
    assert "- vision_encoder: 32 images, 145528 patches: 0.759 s" in text
    assert "- vision_encoder (vision_cudnn.json): 32 images, 145528 patches: 0.500 s, 70.0% MFU" in text


def test_every_engine_throughput_phase_of_bench_gpu_is_summarized():
    """A new engine phase in bench_gpu.py shows up in the summary's engine table (the constrained
    comparisons have their own runs)."""
    source = (REPO_ROOT / "scripts" / "bench_gpu.py").read_text()
    phases = source[source.index("PHASES = (") : source.index(")", source.index("PHASES = ("))]
    engine_phases = {name for name in phases.replace("\n", " ").split('"')
                     if name.startswith("engine") and name.replace("_", "").isalnum()}
    assert "engine_w8a8_channel_tuned" in engine_phases
    assert engine_phases <= set(load_summary().ENGINE_PHASES)


def test_the_tune_plan_files_print_the_tuned_engine_run_and_each_entry_against_its_predecessor(tmp_path, capsys):
    """`engine_tuned.json --tuned tuned_configs.json`: the tuned engine run beside the one as
    served, the tables it read, and every table entry's time against the setting it replaced."""
    from kernels.moe.configs import MoeKernelConfig
    from kernels.paged_decode_configs import DecodeKernelConfig
    from kernels.tuned_configs import decode_entry, moe_entry, write_entries

    table = write_entries(tmp_path / "tuned_configs.json", "NVIDIA H100 80GB HBM3",
                          moe=[moe_entry((128, 2048, 768, "float8_e4m3fn_w8a8", 256),
                                         MoeKernelConfig(32, 64, 256, 1, 4, 5, tuned=True), 0.25, 0.5)],
                          paged_decode=[decode_entry(("float8_e4m3fn", 128, 256), DecodeKernelConfig(32), 0.5, 0.5)])
    record = {"device": "NVIDIA H100 80GB HBM3",
              "engine_w8a8_channel": {"fixed_150_tokens": engine_run(14.5), "tuned_configs": []},
              "engine_w8a8_channel_tuned": {"fixed_150_tokens": engine_run(16.0), "tuned_configs": [str(table)]}}
    (tmp_path / "engine_tuned.json").write_text(json.dumps(record))
    assert load_summary().main([str(tmp_path / "engine_tuned.json"), "--tuned", str(table)]) == 0
    text = capsys.readouterr().out
    assert "| engine_w8a8_channel_tuned | 16.00 |" in text and "| engine_w8a8_channel | 14.50 |" in text
    assert "tuned tables read: engine_w8a8_channel_tuned: tuned_configs.json" in text
    assert "## Tuned table tuned_configs.json (NVIDIA H100 80GB HBM3)" in text
    assert "| moe | dtype=float8_e4m3fn_w8a8 tokens=256 | 32 64 256 1 4 5 | 0.2500 | 0.5000 | 2.00 |" in text
    assert "| paged_decode | kv_dtype=float8_e4m3fn batch=256 | 32 4 2 2 256 | 0.5000 | 0.5000 | 1.00 |" in text


def test_a_sibling_gpu_models_packaged_table_is_named_as_such(tmp_path, capsys):
    """An H200 without a table of its own runs the H100's (kernels/tuned_configs.py): the summary
    says whose table it was."""
    packaged = "/repo/kernels/tuned/NVIDIA_H100_80GB_HBM3.json"
    for device, expected in (("NVIDIA H200", "NVIDIA_H100_80GB_HBM3.json (a sibling's, on this NVIDIA H200)"),
                             ("NVIDIA H100 80GB HBM3", "NVIDIA_H100_80GB_HBM3.json")):
        record = {"device": device, "engine_w8a8_channel": {"fixed_150_tokens": engine_run(17.0),
                                                            "tuned_configs": [packaged]}}
        (tmp_path / "bench_gpu.json").write_text(json.dumps(record))
        assert load_summary().main([str(tmp_path / "bench_gpu.json")]) == 0
        read = [line for line in capsys.readouterr().out.splitlines() if line.startswith("tuned tables read")]
        assert read == [f"tuned tables read: engine_w8a8_channel: {expected}"]
