"""scripts/bench_kernels.py: a clear no-op without a GPU, a working --interpret smoke run, and
bench_gpu.py's kernels phase (which loads bench_kernels.py as a module).

The subprocesses hide any GPU (CUDA_VISIBLE_DEVICES="") and name the interpreter
explicitly, so they behave the same on a GPU machine as on a CPU-only one."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pickle
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "bench_kernels.py"


def cpu_only_env(interpret: bool) -> dict[str, str]:
    """This process's environment with no GPU visible and the interpreter set or unset (and the
    kernel switches unset)."""
    switches = ("VLM_CATALOG_KERNELS", "TRITON_INTERPRET", "VLM_CATALOG_FP8_FAST_ACCUMULATION",
                "VLM_CATALOG_TUNED_CONFIGS")
    env = {key: value for key, value in os.environ.items() if key not in switches}
    env["CUDA_VISIBLE_DEVICES"] = ""
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return env


def run_script(*args: str, script: Path = SCRIPT, interpret: bool = False,
               **variables: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=REPO_ROOT,
        env={**cpu_only_env(interpret), **variables},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def load_bench_gpu():
    spec = importlib.util.spec_from_file_location("bench_gpu_under_test", REPO_ROOT / "scripts" / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_block_ids_rows_time_a_three_stage_table_entry_against_the_ids_in_the_same_iteration(tmp_path):
    """Where the decode config in effect has 3 stages (as the H100 table's at batch 256), the block
    ids' rows time it against the same config loading the ids in the same iteration
    (`decode_ids_ahead` off), every decode case and the full batch, and find the same bits."""
    pytest.importorskip("triton")
    entry = {"block_n": 16, "num_warps": 4, "num_stages": 3, "programs_per_sm": 2, "min_split_tokens": 16,
             "tuned": True}
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"format": 1, "device": "a test's", "moe": [], "paged_decode": [
        {"kv_dtype": "float8_e4m3fn", "head_dim": 32, "batch": batch, "config": entry, "ms": 1.0}
        for batch in (1, 8)]}))
    out = tmp_path / "bench.json"
    result = run_script("--interpret", "--groups", "attention", "--json", str(out), interpret=True,
                        VLM_CATALOG_TUNED_CONFIGS=str(table))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [row for row in json.loads(out.read_text())["rows"] if "fp8 kv, ids" in row["name"]]
    assert [(row["name"], row["shape"]) for row in rows] == [
        ("paged_decode_attention[fp8 kv, ids ahead]", "B=2 ctx=40 (0.4-1.6x)"),
        ("paged_decode_attention[fp8 kv, ids ahead]", "B=3 ctx=40 (0.4-1.6x)")]
    assert all(row["baseline"].startswith("ids in the same iteration (16 positions, 4 warps, 3 stages)")
               and "DIFFERS" not in row["note"] for row in rows), rows


def test_where_the_down_gemm_runs_persistent_a_row_times_it_one_program_per_tile(tmp_path):
    """A tuned table giving the per-channel W8A8 experts 128-row tiles (the prefill tiles, whose down
    GEMM walks its tiles one program per SM) makes the MoE rows time the same call with
    `moe_down_persistent` off, against the row as the engine runs it."""
    pytest.importorskip("triton")
    entry = {"block_size_m": 128, "block_size_n": 32, "block_size_k": 32, "group_size_m": 1, "num_warps": 8,
             "num_stages": 3, "tuned": True}
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"format": 1, "device": "a test's", "paged_decode": [], "moe": [
        {"num_experts": 8, "hidden": 64, "intermediate": 32, "dtype": "float8_e4m3fn_w8a8", "tokens": tokens,
         "config": entry, "ms": 1.0} for tokens in (4, 16)]}))
    out = tmp_path / "bench.json"
    result = run_script("--interpret", "--groups", "moe", "--json", str(out), interpret=True,
                        VLM_CATALOG_TUNED_CONFIGS=str(table))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [row for row in json.loads(out.read_text())["rows"] if "one program per down tile" in row["name"]]
    assert [row["shape"] for row in rows] == ["T=4", "T=16"], rows
    assert all(row["baseline"] == "fp8 w8a8, per-channel" and row["triton_ms"] > 0 for row in rows), rows


def test_without_a_gpu_it_says_so_and_exits_0():
    result = run_script()
    assert result.returncode == 0, result.stderr
    assert "no CUDA GPU" in result.stdout


def test_interpret_smoke_run_writes_json(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "bench.json"
    result = run_script("--interpret", "--json", str(out), interpret=True)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    names = {row["name"] for row in report["rows"]}
    assert {
        "fused_moe",
        "paged_decode_attention",
        "paged_prefill_attention",
        "varlen_attention",
        "fp8_linear[w8a16]",
        "fp8_linear[w8a8]",
        "fp8_linear[w8a8, per-channel]",
        "fused_moe[fp8 w8a8, per-channel]",
        "fused_moe[fp8 w8a8, per-channel, fast accumulation]",
        "fused_moe[grouped_mm]",  # torch's bf16 grouped GEMM runs on CPU too
        "paged_prefill_attention[fresh]",
        "fused_sum_add_rms_norm",
        "fused_sum_add_rms_norm[FP8 out]",
        "moe_align_block_size[one launch]",
        "route_topk_and_align[one launch]",
        "add_rms_norm_router[one launch]",
        "add_rms_norm_route[one launch]",
        "skinny_linear[16x256, 4 warps, 4 stages]",
        "paged_decode_attention[fp8 kv, ids ahead, 3 stages]",  # the default config's 2 stages, against 3
        "paged_decode_attention[fp8 kv, heads together]",
    } <= names
    assert all(row["triton_ms"] > 0 and row["baseline_ms"] > 0 for row in report["rows"])
    assert not any("DIFFERS" in row["note"] for row in report["rows"]), report["rows"]
    assert report["groups"] == ["elementwise", "attention", "moe", "dense_fp8"]  # all by default
    assert report["kernels_off"] == [] and report["fp8_fast_accumulation"] is False  # the switches, recorded


def test_the_attention_rows_run_with_the_fp8_cache_paths_turned_off(tmp_path):
    """The `decode` plan of gpu_session.py times the attention rows with V read as bytes and with
    bf16 dots; the JSON says which."""
    pytest.importorskip("triton")
    out = tmp_path / "bench.json"
    result = run_script("--interpret", "--groups", "attention", "--json", str(out), interpret=True,
                        VLM_CATALOG_KERNELS_OFF="fp8_v_words,fp8_float16_dots")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["kernels_off"] == ["fp8_float16_dots", "fp8_v_words"] and not report["errors"]
    rows = {row["name"]: row for row in report["rows"]}
    assert "paged_decode_attention[fp8 kv]" in rows
    # the FP8 cache with head-major pages: the same bits as the engine's layout (the note would say)
    head_major = rows["paged_decode_attention[fp8 kv, head-major pages]"]
    assert head_major["note"] == "" and head_major["baseline"] == "the engine's layout ([fp8 kv])"
    # cuDNN first for the long images' SDPA: on CPU there is none, and the note says so
    assert rows["varlen_attention[sdpa, cudnn]"]["note"].startswith("no cuDNN on this device")


def test_tune_moe_w8a8_prints_entries_of_its_own():
    """--tune-moe --fp8 --w8a8 times the W8A8 GEMMs and keys their lines 'float8_e4m3fn_w8a8'."""
    pytest.importorskip("triton")
    result = run_script("--interpret", "--tune-moe", "--fp8", "--w8a8", "--buckets", "4", "--compile-workers", "0",
                        interpret=True)
    assert result.returncode == 0, result.stdout + result.stderr
    (entry,) = [line for line in result.stdout.splitlines() if "MoeKernelConfig(" in line]
    assert "'float8_e4m3fn_w8a8', 4)" in entry
    refused = run_script("--interpret", "--tune-moe", "--w8a8", interpret=True)
    assert refused.returncode == 2 and "--w8a8 goes with --tune-moe --fp8" in refused.stderr


def test_tune_moe_per_channel_prints_entries_of_its_own():
    """--tune-moe --fp8 --w8a8 --per-channel times the per-channel W8A8 GEMMs (the scales after
    the K loop) and keys their lines 'float8_e4m3fn_w8a8_channel' under fast accumulation, whose
    loops have tiles of their own; summed into float32 every K step (the default) they take, and
    so print, the block-scaled W8A8 key."""
    pytest.importorskip("triton")
    for fast, key in (("1", "'float8_e4m3fn_w8a8_channel', 4)"), ("0", "'float8_e4m3fn_w8a8', 4)")):
        result = run_script("--interpret", "--tune-moe", "--fp8", "--w8a8", "--per-channel", "--buckets", "4",
                            "--compile-workers", "0", interpret=True, VLM_CATALOG_FP8_FAST_ACCUMULATION=fast)
        assert result.returncode == 0, result.stdout + result.stderr
        (entry,) = [line for line in result.stdout.splitlines() if "MoeKernelConfig(" in line]
        assert key in entry, (fast, entry)
    refused = run_script("--interpret", "--tune-moe", "--per-channel", interpret=True)
    assert refused.returncode == 2 and "--per-channel goes with --tune-moe --fp8" in refused.stderr


def test_tune_moe_compiles_in_workers_and_prints_entries_to_paste():
    """--tune-moe with compile workers (the GPU default): each bucket's candidates are compiled
    in worker processes first, then timed; each bucket ends in a line for MOE_CONFIGS."""
    pytest.importorskip("triton")
    from kernels.moe.configs import MoeKernelConfig

    result = run_script("--interpret", "--tune-moe", "--buckets", "4", "64", "--compile-workers", "2", interpret=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "# T=4: 2 of 2 configs compiled by 2 workers" in result.stdout
    entries = [line for line in result.stdout.splitlines() if "MoeKernelConfig(" in line]
    assert len(entries) == 2
    for bucket, entry in zip((4, 64), entries):
        table = eval("{" + entry.strip() + "}", {"MoeKernelConfig": MoeKernelConfig})  # as pasted into the dict
        ((key, config),) = table.items()
        assert key[-1] == bucket and config.tuned


def test_tuners_write_their_bests_into_a_table_the_lookups_read(tmp_path):
    """--write-table: each bucket's best (the config in effect competing, its time kept as
    default_ms) goes into one JSON table, MoE tiles and decode launches alike, merged across
    runs; pointed at by VLM_CATALOG_TUNED_CONFIGS, the lookups return those entries."""
    pytest.importorskip("triton")
    from kernels.moe.configs import MoeKernelConfig
    from kernels.paged_decode_configs import DecodeKernelConfig
    from kernels.tuned_configs import load_table

    table = tmp_path / "tuned.json"
    moe = run_script("--interpret", "--tune-moe", "--buckets", "4", "64", "--compile-workers", "0",
                     "--write-table", str(table), interpret=True)
    assert moe.returncode == 0, moe.stdout + moe.stderr
    assert moe.stdout.count("for the config in effect") == 2 and f"# T=64: written to {table}" in moe.stdout
    decode = run_script("--interpret", "--tune-decode", "--fp8", "--write-table", str(table), interpret=True)
    assert decode.returncode == 0, decode.stdout + decode.stderr
    written = load_table(table)
    pasted = [line for line in moe.stdout.splitlines() if "MoeKernelConfig(" in line]
    assert written.moe == {key: config for line in pasted
                           for key, config in eval("{" + line.strip() + "}", {"MoeKernelConfig": MoeKernelConfig}).items()}
    pasted = [line for line in decode.stdout.splitlines() if "DecodeKernelConfig(" in line]
    assert written.paged_decode == {
        key: config for line in pasted
        for key, config in eval("{" + line.strip() + "}", {"DecodeKernelConfig": DecodeKernelConfig}).items()}
    entries = json.loads(table.read_text())["moe"]
    assert all(entry["ms"] > 0 and entry["default_ms"] >= entry["ms"] for entry in entries), entries
    # the engine's lookups, in a process told to use the table
    ((key, config),) = [(key, config) for key, config in written.moe.items() if key[-1] == 64]
    experts, hidden, intermediate, dtype, _ = key
    probe = ("import torch; from kernels.moe.configs import get_moe_config; "
             f"print(get_moe_config(64, {experts}, {hidden}, {intermediate}, torch.{dtype}, top_k=2, device='cpu'))")
    env = {**cpu_only_env(False), "VLM_CATALOG_TUNED_CONFIGS": str(table)}
    looked_up = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO_ROOT, env=env,
                               timeout=120)
    assert looked_up.stdout.strip() == repr(config), looked_up.stderr
    refused = run_script("--write-table", str(table))
    assert refused.returncode == 2 and "--write-table goes with --tune-moe or --tune-decode" in refused.stderr


def test_tune_decode_prints_entries_to_paste():
    """--tune-decode: per batch bucket, the best launch (the default competing) and its line for
    DECODE_CONFIGS."""
    pytest.importorskip("triton")
    from kernels.paged_decode_configs import DecodeKernelConfig, decode_batch_bucket

    result = run_script("--interpret", "--tune-decode", "--fp8", interpret=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("with the default") == 2  # the tiny shapes' two batches
    entries = [line for line in result.stdout.splitlines() if "DecodeKernelConfig(" in line]
    assert len(entries) == 2
    for batch, entry in zip((1, 2), entries):
        ((key, config),) = eval("{" + entry.strip() + "}", {"DecodeKernelConfig": DecodeKernelConfig}).items()
        assert key == ("float8_e4m3fn", 32, decode_batch_bucket(batch)) and config.tuned


def test_decode_tuning_spreads_context_lengths_around_the_mean():
    """--tune-decode times batches whose contexts differ (0.4-1.6 x the mean), as a decode batch's
    do: one split per sequence leaves the longest as the tail, which equal lengths would hide."""
    spread_lengths = load_bench_gpu().load_bench_kernels().spread_lengths
    lengths = spread_lengths(256, 2048)
    assert len(lengths) == 256 and min(lengths) == round(0.4 * 2048) and max(lengths) == round(1.6 * 2048)
    assert abs(sum(lengths) / 256 - 2048) < 1
    assert lengths != sorted(lengths) and lengths == spread_lengths(256, 2048)  # shuffled, the same every run
    assert spread_lengths(1, 2048) == [2048]


def test_moe_candidates_search_longer_k_steps_and_deeper_pipelines_at_decode_sizes():
    """Decode-sized buckets (an expert's weights streamed for one or two row blocks) try K steps up
    to 256 and 2-5 stages' worth of pipeline, without GROUP_M variants; `max_block_k` 128 keeps
    the FP8 loops' steps within their scale blocks; prefill-sized buckets keep their space."""
    candidate_configs = load_bench_gpu().load_bench_kernels().candidate_configs
    decode = list(candidate_configs(16))
    assert {c.block_size_k for c in decode} == {64, 128, 256} and {c.num_stages for c in decode} == {3, 4, 5}
    assert {c.group_size_m for c in decode} == {1} and {c.block_size_m for c in decode} == {16, 32}
    assert len(decode) == len(set(decode)) == 2 * 3 * 3 * 2 * 3
    assert {c.block_size_k for c in candidate_configs(16, max_block_k=128)} == {64, 128}
    prefill = list(candidate_configs(1024))
    assert {c.block_size_k for c in prefill} == {64, 128} and {c.group_size_m for c in prefill} == {1, 8}
    assert {c.block_size_m for c in prefill} == {32, 64, 128} and len(prefill) == 3 * 3 * 2 * 2 * 2 * 2


def test_the_moe_tuner_times_only_tiles_that_fit_shared_memory(triton_device, monkeypatch, capsys):
    """Candidates whose pipeline cannot fit a block's shared memory (for the weights' element size)
    are not compiled or timed."""
    from kernels.moe.configs import MoeKernelConfig

    bench_kernels = load_bench_gpu().load_bench_kernels()
    fits, too_big = MoeKernelConfig(16, 32, 64, 1, 4, 3, tuned=True), MoeKernelConfig(32, 128, 256, 1, 4, 5, tuned=True)
    monkeypatch.setattr(bench_kernels, "candidate_configs", lambda rows, max_block_k=256: iter([too_big, fits]))
    timed = []
    monkeypatch.setattr(bench_kernels, "make_timer", lambda device: lambda run: timed.append(run.keywords["config"]) or 1.0)
    bench_kernels.tune_moe(triton_device, bench_kernels.TINY_SHAPES, buckets=[16])
    assert too_big not in timed and fits in timed


def test_a_compile_worker_skips_a_config_that_fails(triton_device):
    """One bad config costs a worker nothing but that config (the timing loop reports it)."""
    bench_kernels = load_bench_gpu().load_bench_kernels()
    good = next(iter(bench_kernels.candidate_configs(0.25)))
    ran = bench_kernels._compile_moe_configs(str(triton_device), 4, bench_kernels.TINY_SHAPES, "float32",
                                             bench_kernels.ExpertFormat(), [good, {"block_size_m": 16}])
    assert ran == 1


def test_bench_gpu_loads_bench_kernels_as_a_registered_module():
    """bench_gpu.py once exec'd bench_kernels.py without a sys.modules entry: its
    @dataclass then failed (dataclasses look the defining module up there)."""
    bench_gpu = load_bench_gpu()
    sys.modules.pop("bench_kernels", None)
    try:
        module = bench_gpu.load_bench_kernels()
        assert sys.modules["bench_kernels"] is module
        assert bench_gpu.load_bench_kernels() is module  # loaded once
        row = module.Row("op", "T=1", 2.0, "torch", 4.0, "1 GB/s", target_speedup=1.5)
        assert row.speedup == 2.0 and row.meets_target
        assert module.TINY_SHAPES.hidden < module.GPU_SHAPES.hidden
    finally:
        sys.modules.pop("bench_kernels", None)


def test_bench_gpu_kernels_phase_runs_on_cpu(tmp_path):
    """bench_gpu.py's kernels phase under the interpreter it sets up itself, one group of rows
    (`--kernel-groups`; the whole table: test_interpret_smoke_run_writes_json)."""
    pytest.importorskip("triton")
    out = tmp_path / "bench_gpu.json"
    result = run_script("--tiny", "--device", "cpu", "--phases", "kernels", "--kernel-groups", "elementwise",
                        "--json", str(out), script=REPO_ROOT / "scripts" / "bench_gpu.py")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())["kernels"]
    assert report["device"] == "cpu (Triton interpreter)" and report["groups"] == ["elementwise"]
    names = {row["name"] for row in report["rows"]}
    assert {"rms_norm", "qk_norm_mrope", "route_topk"} <= names
    assert not names & {"fused_moe", "paged_decode_attention", "varlen_attention"}  # the other groups did not run
    assert all(row["triton_ms"] > 0 for row in report["rows"])


def test_unknown_kernel_groups_are_named():
    bench_kernels = load_bench_gpu().load_bench_kernels()
    assert bench_kernels.parse_groups(" moe,attention ") == ("moe", "attention")
    refused = run_script("--interpret", "--groups", "moe,atention")
    assert refused.returncode == 2 and "unknown benchmark group(s) atention" in refused.stderr
    refused = run_script("--tiny", "--device", "cpu", "--phases", "kernels", "--kernel-groups", ",",
                         script=REPO_ROOT / "scripts" / "bench_gpu.py")
    assert refused.returncode == 2 and "(none given)" in refused.stderr


def test_vision_flops_match_torch_flop_counter(monkeypatch):
    """The vision_encoder phase's MFU numerator: every matmul, linear and attention of the tower
    (attention as explicit matmuls here: the counter does not see CPU SDPA)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    import kernels
    from tests.model.test_vision_tables import images, tiny_tower

    def matmul_attention(q, k, v, cu_seqlens, scale, **_):
        out = torch.empty_like(q)
        bounds = cu_seqlens.tolist()
        for begin, end in zip(bounds, bounds[1:]):
            qs, ks, vs = (x[begin:end].transpose(0, 1) for x in (q, k, v))  # [h, n, d]
            out[begin:end] = (torch.softmax(qs @ ks.transpose(1, 2) * scale, -1) @ vs).transpose(0, 1)
        return out

    monkeypatch.setattr(kernels, "varlen_attention", matmul_attention)
    tower = tiny_tower()
    grids = [(1, 4, 6), (2, 8, 4)]
    pixels, grid_thw = images(grids, tower.config.patch_dim)
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        tower(pixels, grid_thw)
    assert load_bench_gpu().vision_flops(tower.config, grids) == counter.get_total_flops()


def test_bench_gpu_phases_smoke_on_cpu(tmp_path):
    """Every model phase of bench_gpu.py on the tiny model (kernels: see above; ceilings and
    roofline: the slow test below), each written to the JSON as it finishes."""
    from kernels.moe.configs import MoeKernelConfig
    from kernels.tuned_configs import moe_entry, write_entries

    out = tmp_path / "bench_gpu.json"
    table = write_entries(tmp_path / "tuned.json", None, moe=[moe_entry(
        (8, 64, 32, "float8_e4m3fn_w8a8", 16), MoeKernelConfig(16, 32, 64, 1, 4, 2, tuned=True), 0.1, 0.2)])
    result = run_script("--tiny", "--device", "cpu", "--records", "2", "--vision-images", "2", "--hf-records", "2",
                        "--image-size", "small", "--output-tokens", "4", "--warmup-records", "1",
                        "--phases", "vision_encoder,engine,engine_fp8_kv,constrained,engine_fp8,engine_w8a8,"
                        "engine_w8a8_channel,engine_w8a8_channel_grouped_mm,engine_w8a8_channel_fast,"
                        "engine_w8a8_channel_fa3,engine_w8a8_channel_fa2,engine_w8a8_channel_tuned,"
                        "constrained_w8a8_channel,transformers",
                        "--tuned-configs", str(table), "--repeat-runs", "2", "--json", str(out),
                        script=REPO_ROOT / "scripts" / "bench_gpu.py")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    # --repeat-runs 2: every engine phase's run timed twice, the constrained run again after the
    # unconstrained one, each with its own summary
    for phase in ("engine", "engine_w8a8_channel"):
        first, (again,) = report[phase]["fixed_150_tokens"], report[phase]["fixed_150_tokens_again"]
        assert again["generated_tokens"] == first["generated_tokens"] and again["errors"] == 0
        assert again["seconds"] > 0 and report[phase]["repeat_runs"] == 2
        # then the untimed routing pass over the records, every router's choices counted
        routing = report[phase]["routing"]
        assert routing["layers"] >= 1 and routing["large_calls"]["calls"] >= 1 and routing["small_calls"]["calls"] >= 1
    for phase in ("constrained", "constrained_w8a8_channel"):
        again = report[phase]["constrained_again"]
        assert again["generated_tokens"] == report[phase]["constrained_real_stop"]["generated_tokens"]
        assert again["grammar_fill_seconds"] > 0 and report[phase]["constrained_again_same_tokens"]
        assert report[phase]["constrained_again_over_unconstrained"] == pytest.approx(
            again["samples_per_s"] / report[phase]["unconstrained_same_tokens"]["samples_per_s"])
        # and with jump-forward the other way (on the CPU, where it is on: off), the same tokens
        other = report[phase]["other_jump_forward"]
        assert other["jump_forward"] is False and other["same_tokens"]
        assert other["run"]["generated_tokens"] == again["generated_tokens"] and other["run"]["jump_forward_tokens"] == 0
        assert report[phase]["constrained_real_stop"]["jump_forward_tokens"] > 0
    vision = report["vision_encoder"]
    assert vision["images"] == 2 and vision["patches"] > 0 and vision["seconds"] > 0 and 0 < vision["mfu"]
    engine = report["engine"]["fixed_150_tokens"]
    assert engine["generated_tokens"] == 2 * 4 and engine["errors"] == 0
    assert engine["queue_seconds"] > 0 and engine["image_wait_seconds"] >= 0 and engine["images_prefetched"] >= 0
    assert 0 < engine["vision_encoder_seconds"] < engine["seconds"]
    split = engine["device_seconds"]  # on CPU the host clock: every part is real time of the run
    assert split["vision_encoder"] == engine["vision_encoder_seconds"]
    assert split["text_forward_prefill_steps"] > 0 and split["text_forward_decode_steps"] > 0
    assert split["rest_of_steps"] >= 0 and split["between_steps"] >= 0
    assert sum(split.values()) == pytest.approx(engine["seconds"])
    assert 1 <= engine["prefill_steps"] < engine["model_steps"]
    host = engine["host_forward_seconds"]  # on CPU the forward's host clock is its time
    assert host["prefill_steps"] == pytest.approx(split["text_forward_prefill_steps"], rel=0.05)
    assert host["decode_steps"] == pytest.approx(split["text_forward_decode_steps"], rel=0.05)
    # the host's time in step(): on CPU nothing is waited for, and the host's work is the run
    host = engine["host_seconds"]
    assert host["scheduling"] > 0 and host["outputs"] > 0 and host["steps"] > 0
    assert host["waiting_for_sampled_tokens"] == {"prefill_steps": 0.0, "decode_steps": 0.0}
    assert host["working"] == pytest.approx(host["scheduling"] + host["steps"] + host["outputs"])
    assert host["working"] <= engine["seconds"] and host["steps"] >= sum(split.values()) - split["between_steps"]
    constrained = report["constrained"]
    # equal generated tokens by construction, both reported
    assert constrained["constrained_real_stop"]["generated_tokens"] == constrained["unconstrained_same_tokens"]["generated_tokens"]
    assert constrained["constrained_over_unconstrained"] > 0
    # the grammars' host time: only the constrained run has any
    assert constrained["constrained_real_stop"]["grammar_fill_seconds"] > 0
    assert constrained["constrained_real_stop"]["grammar_advance_seconds"] > 0
    assert constrained["unconstrained_same_tokens"]["grammar_fill_seconds"] == 0
    assert constrained["unconstrained_same_tokens"]["grammar_advance_seconds"] == 0
    assert constrained["constrained_real_stop"]["logit_masking_seconds"] > 0
    assert constrained["unconstrained_same_tokens"]["logit_masking_seconds"] == 0
    assert constrained["constrained_real_stop"]["grammar_wait_seconds_mean"] > 0
    assert constrained["unconstrained_same_tokens"]["grammar_wait_seconds_mean"] == 0
    assert 1 <= constrained["grammar_compilations"] <= 2 and constrained["grammar_compile_seconds"] > 0
    assert report["engine"]["kv_cache_tokens"] > 0
    assert report["engine"]["decode_cuda_graph_batches"] == []  # graphs are CUDA-only
    assert report["constrained"]["jump_forward"]  # so every step runs eagerly, and jump-forward is on
    assert report["engine"]["engine_warmup"] is None  # the engine warm-up is CUDA-only by default
    assert report["engine_w8a8"]["fp8_linear_cublas"] == {}  # cuBLAS FP8 is Hopper-only: no shape was checked
    assert report["engine"]["gelu_gemm_epilogue"] == {}  # the GELU epilogue is CUDA-only: likewise
    # one other record runs untimed before each engine phase's timed run
    for phase in ("engine", "engine_fp8_kv", "constrained", "engine_fp8", "engine_w8a8", "engine_w8a8_channel"):
        assert report[phase]["warmup"]["records"] == 1 and report[phase]["warmup"]["seconds"] > 0, phase
    assert report["kernels_off"] == [] and report["versions"]["torch"] and report["versions"]["xgrammar"]
    assert report["engine_output_kind"] == "final_only"  # as the offline front doors ask
    assert report["moe_gemm"] == "triton" and report["engine"]["moe_grouped_gemm"] == {}  # unless asked
    assert report["sdpa_backend"] == "default"  # torch's own order unless VLM_CATALOG_SDPA_BACKEND says otherwise
    assert report["flash_varlen"] == "torch"  # FlashAttention 3 only where it can run (a Hopper GPU)
    # the engine phases sample as the benchmark does (the checkpoint's generation_config)
    assert report["engine"]["sampling"] == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert report["engine_w8a8"]["sampling"] == report["engine"]["sampling"]
    fp8 = report["engine_fp8_kv"]  # the CPU default pool holds float32: 4x the tokens in e4m3
    assert fp8["kv_cache_tokens"] == 4 * report["engine"]["kv_cache_tokens"]
    assert fp8["fixed_150_tokens"]["generated_tokens"] == 2 * 4 and fp8["fixed_150_tokens"]["errors"] == 0
    fp8_experts = report["engine_fp8"]  # experts in one byte per weight instead of four (float32 on CPU)
    before, after = fp8_experts["before"], fp8_experts["after"]
    assert after["expert_weight_bytes"] < 0.3 * before["expert_weight_bytes"]
    assert after["weight_bytes"] == before["weight_bytes"] - before["expert_weight_bytes"] + after["expert_weight_bytes"]
    assert fp8_experts["fixed_150_tokens"]["errors"] == 0 and fp8_experts["kv_cache_tokens"] == fp8["kv_cache_tokens"]
    assert after["dense_projection_bytes"] == before["dense_projection_bytes"]  # W8A16 experts only
    w8a8 = report["engine_w8a8"]  # the experts were already FP8; the dense projections become FP8 too
    assert w8a8["before"] == fp8_experts["after"] and w8a8["fixed_150_tokens"]["errors"] == 0
    assert w8a8["after"]["dense_projection_bytes"] < 0.3 * w8a8["before"]["dense_projection_bytes"]
    assert w8a8["after"]["expert_weight_bytes"] == w8a8["before"]["expert_weight_bytes"]
    # per-channel: the same FP8 weights requantized with one scale per row (a row of scales more)
    channel = report["engine_w8a8_channel"]
    assert channel["expert_block"][0] == 1 and channel["dense_block"][0] == 1 and w8a8["expert_block"][0] > 1
    assert channel["before"] == w8a8["after"] and channel["fixed_150_tokens"]["errors"] == 0
    assert channel["after"]["dense_projection_bytes"] < 0.3 * w8a8["before"]["dense_projection_bytes"]
    # the same weights again, with the FP8 GEMMs' sums left in the tensor core (recorded as such)
    fast = report["engine_w8a8_channel_fast"]
    assert fast["fp8_fast_accumulation"] and not channel["fp8_fast_accumulation"]
    assert fast["before"] == channel["after"] == fast["after"] and fast["fixed_150_tokens"]["errors"] == 0
    assert fast["expert_block"] == channel["expert_block"]
    # and with the MoE GEMMs asked of torch's grouped GEMMs: set for that phase alone (on CPU the
    # experts keep the reference: the grouped path is for Hopper GPUs, so nothing was checked)
    grouped = report["engine_w8a8_channel_grouped_mm"]
    assert grouped["moe_gemm"] == "grouped_mm" and channel["moe_gemm"] == fast["moe_gemm"] == "triton"
    assert grouped["fixed_150_tokens"]["errors"] == 0 and grouped["moe_grouped_gemm"] == {}
    # FlashAttention 3 asked for, for that phase alone (on CPU the torch path runs: no varlen call)
    fa3 = report["engine_w8a8_channel_fa3"]
    assert fa3["flash_varlen"] == "torch" and fa3["fixed_150_tokens"]["errors"] == 0
    fa2 = report["engine_w8a8_channel_fa2"]  # torch's FlashAttention 2 asked for by name
    assert fa2["flash_varlen"] == "torch" and fa2["fixed_150_tokens"]["errors"] == 0
    # the tuned table named for that phase alone, and recorded (no packaged table for a CPU)
    tuned = report["engine_w8a8_channel_tuned"]
    assert tuned["tuned_configs"] == [str(table)] and tuned["fixed_150_tokens"]["errors"] == 0
    assert channel["tuned_configs"] == fa2["tuned_configs"] == report["engine"]["tuned_configs"] == []
    # the constrained comparison again on the per-channel W8A8 model and an FP8 cache (4x the
    # float32 tokens), the same tokens both ways
    served = report["constrained_w8a8_channel"]
    assert served["kv_cache_tokens"] == fp8["kv_cache_tokens"] and served["expert_block"][0] == 1
    assert served["constrained_real_stop"]["generated_tokens"] == served["unconstrained_same_tokens"]["generated_tokens"]
    assert served["constrained_real_stop"]["grammar_fill_seconds"] > 0 and served["constrained_over_unconstrained"] > 0
    hf = report["transformers"]
    assert hf["batch_1_probe"]["samples_per_s"] > 0 and hf["batch_chosen"] >= 1 and hf["best_samples_per_s"] > 0
    # vision_encoder needs the matmul peak: ceilings are measured for it
    assert set(report["phase_seconds"]) == {"ceilings", "vision_encoder", "engine", "engine_fp8_kv", "constrained",
                                            "engine_fp8", "engine_w8a8", "engine_w8a8_channel",
                                            "engine_w8a8_channel_grouped_mm", "engine_w8a8_channel_fast",
                                            "engine_w8a8_channel_fa3", "engine_w8a8_channel_fa2",
                                            "engine_w8a8_channel_tuned", "constrained_w8a8_channel", "transformers"}


def test_the_tuned_engine_phase_needs_a_table_that_reads(tmp_path):
    """engine_w8a8_channel_tuned refuses to start without --tuned-configs, or with a table that
    cannot be used, before any other phase has run."""
    bench_gpu = REPO_ROOT / "scripts" / "bench_gpu.py"
    missing = run_script("--tiny", "--device", "cpu", "--phases", "engine,engine_w8a8_channel_tuned", script=bench_gpu)
    assert missing.returncode == 2 and "engine_w8a8_channel_tuned needs --tuned-configs PATH" in missing.stderr
    broken = tmp_path / "tuned.json"
    broken.write_text('{"format": 1, "moe": [{"num_experts": 8}]}')
    refused = run_script("--tiny", "--device", "cpu", "--phases", "engine_w8a8_channel_tuned", "--tuned-configs",
                         str(broken), script=bench_gpu)
    assert refused.returncode == 2 and f"tuned table {broken}: moe entry 0: missing hidden" in refused.stderr


@pytest.mark.slow
def test_bench_gpu_single_phases_on_cpu(tmp_path):
    """--phase runs one phase alone; results of separate runs merge into one JSON."""
    out = tmp_path / "bench_gpu.json"
    for phase in ("ceilings", "roofline"):
        result = run_script("--tiny", "--device", "cpu", "--phase", phase, "--json", str(out),
                            script=REPO_ROOT / "scripts" / "bench_gpu.py")
        assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["ceilings"]["matmul_flops_per_s"] > 0 and report["ceilings"]["matmul_dtype"] == "float32"
    assert report["roofline"]["prefill_tokens_per_s"] > 0
    # the step as the engine runs it, with its logits (the floor counts lm_head), and the graph alone
    assert report["roofline"]["decode_batch1_seconds"] > 0 and report["roofline"]["decode_batch1_graph_seconds"] > 0
    breakdown = report["roofline"]["decode_batch1_kernels"]  # on a CPU: the ops' own CPU time
    assert breakdown["time"] == "cpu" and breakdown["total_us_per_step"] > 0 and breakdown["kernels"]
    large = report["roofline"]["decode_large_batch"]  # a small "large" batch on a CPU
    assert (large["batch"], large["context"]) == (4, 32) and large["seconds"] > 0 and large["tokens_per_s"] > 0
    assert large["kernels"]["total_us_per_step"] > 0 and not large["cuda_graphs"]
    assert report["roofline"]["decode_batch1_pdl"] == {"skipped": "programmatic dependent launch needs a CUDA device"}
    assert report["roofline"]["decode_batch1_pdl_without_prefetch"] == {
        "skipped": "programmatic dependent launch needs a CUDA device"}
    unfused = report["roofline"]["decode_batch1_unfused"]  # the same step with the newest fusions off
    assert unfused["kernels_off"] == ["add_rms_norm_router", "decode_merge_in_place", "skinny_linear"]
    assert unfused["seconds"] > 0
    assert report["pdl"] is False and report["kv_layout"] == "interleaved"


def test_kernel_breakdown_sums_a_steps_time_by_kernel_and_records_a_failure():
    bench_gpu = load_bench_gpu()
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def step():
        (a @ b).relu_()
        (a @ b) @ b

    breakdown = bench_gpu.kernel_breakdown(step, torch.device("cpu"), steps=4)
    rows = breakdown["kernels"]
    by_name = {row["name"]: row for row in rows}
    assert breakdown["steps"] == 4 and breakdown["time"] == "cpu"
    assert by_name["aten::mm"]["calls_per_step"] == 3 and by_name["aten::relu_"]["calls_per_step"] == 1
    assert [row["us_per_step"] for row in rows] == sorted((row["us_per_step"] for row in rows), reverse=True)
    assert breakdown["total_us_per_step"] >= by_name["aten::mm"]["us_per_step"] > 0

    def failing():
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    assert bench_gpu.kernel_breakdown(failing, torch.device("cpu")) == {
        "error": "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"}


def test_bench_gpu_engine_sampling_greedy_is_recorded(tmp_path):
    out = tmp_path / "bench_gpu.json"
    result = run_script("--tiny", "--device", "cpu", "--records", "1", "--image-size", "small", "--output-tokens", "2",
                        "--phase", "engine", "--engine-sampling", "greedy", "--json", str(out),
                        script=REPO_ROOT / "scripts" / "bench_gpu.py")
    assert result.returncode == 0, result.stdout + result.stderr
    engine = json.loads(out.read_text())["engine"]
    assert engine["warmup"] == {"records": 0, "seconds": 0.0}  # none by default on CPU
    assert engine["sampling"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
    assert engine["fixed_150_tokens"]["generated_tokens"] == 2 and engine["async_scheduling"] is False  # auto, CPU
    diagnostics = engine["fixed_150_tokens"]["diagnostics"]  # bench/run_diagnostics.py
    assert set(diagnostics) == {"triton_variants", "triton_variant_seconds", "gc", "cuda_allocator"}
    assert diagnostics["cuda_allocator"] is None and diagnostics["gc"]["seconds"] >= 0


def test_bench_gpu_engine_with_async_scheduling(tmp_path):
    out = tmp_path / "bench_gpu.json"
    result = run_script("--tiny", "--device", "cpu", "--records", "2", "--image-size", "small", "--output-tokens", "3",
                        "--phase", "engine", "--async-scheduling", "--max-num-batched-tokens", "96",
                        "--json", str(out), script=REPO_ROOT / "scripts" / "bench_gpu.py")
    assert result.returncode == 0, result.stdout + result.stderr
    engine = json.loads(out.read_text())["engine"]
    assert engine["async_scheduling"] is True and engine["max_num_batched_tokens"] == 96
    assert engine["fixed_150_tokens"]["generated_tokens"] == 2 * 3 and engine["fixed_150_tokens"]["errors"] == 0


def test_bench_gpu_engine_profile_splits_the_runs_time_by_region_and_kind(tmp_path):
    """engine_profile on CPU: the per-channel W8A8 engine under torch.profiler, its torch ops
    charged to the engine's marked regions (device_profile; on CUDA the device's kernels)."""
    out = tmp_path / "bench_gpu.json"
    result = run_script("--tiny", "--device", "cpu", "--records", "3", "--profile-records", "2",
                        "--image-size", "small", "--output-tokens", "3", "--phase", "engine_profile",
                        "--json", str(out), script=REPO_ROOT / "scripts" / "bench_gpu.py")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())["engine_profile"]
    run = report["fixed_150_tokens"]
    assert run["generated_tokens"] == 2 * 3 and run["errors"] == 0  # the first 2 records, not 3
    profile = report["profile"]
    regions = profile["regions"]
    assert {"vlm.vision_encoder", "vlm.text_forward.prefill", "vlm.text_forward.decode", "vlm.step"} <= set(regions)
    for region in ("vlm.vision_encoder", "vlm.text_forward.prefill"):  # each its own GEMMs and attention
        assert regions[region]["kinds"]["gemm"] > 0 and regions[region]["kinds"]["attention"] > 0, region
    assert "gemm" not in regions["vlm.step"]["kinds"]  # the rest of a step: sampling, not the model
    assert 0 < profile["busy_seconds"] <= profile["wall_seconds"] and 0 < profile["busy_fraction"] <= 1


def bench_gpu_where(monkeypatch, tmp_path, function: str, error: Exception, *args: str) -> tuple[int, dict]:
    """bench_gpu.main on the tiny CPU model (one small record) with `function` raising `error`:
    its exit status and the JSON it wrote."""
    bench_gpu = load_bench_gpu()

    def fail(*_args, **_kwargs):
        raise error

    monkeypatch.setattr(bench_gpu, function, fail)
    out = tmp_path / "bench_gpu.json"
    status = bench_gpu.main(["--tiny", "--device", "cpu", "--records", "1", "--image-size", "small",
                             *args, "--json", str(out)])
    return status, json.loads(out.read_text())


def test_bench_gpu_a_failing_phase_does_not_stop_the_others(tmp_path, monkeypatch, capsys):
    """A crash or out-of-memory in one phase is recorded as its error; the later phases still run
    (a GPU session is 30 minutes), and the exit status says something failed."""
    crash = RuntimeError("CUDA error: an illegal memory access was encountered")
    status, report = bench_gpu_where(monkeypatch, tmp_path, "measure_ceilings", crash,
                                     "--output-tokens", "2", "--phases", "ceilings,engine")
    assert status == 1
    assert report["ceilings"] == {"error": "RuntimeError: CUDA error: an illegal memory access was encountered"}
    assert report["engine"]["fixed_150_tokens"]["generated_tokens"] == 2
    assert "failed phases: ceilings" in capsys.readouterr().out


def test_bench_gpu_a_failing_routing_pass_keeps_the_phases_timed_runs(tmp_path, monkeypatch):
    """The routing pass after an engine phase's timed runs only counts the routers' choices: its
    failure is recorded in the phase's `routing`, and the timed runs and the exit status stand."""
    crash = RuntimeError("CUDA error: an illegal memory access was encountered")
    status, report = bench_gpu_where(monkeypatch, tmp_path, "routing_pass", crash,
                                     "--output-tokens", "2", "--phase", "engine")
    assert status == 0
    assert report["engine"]["fixed_150_tokens"]["generated_tokens"] == 2
    assert report["engine"]["routing"] == {"error": "RuntimeError: CUDA error: an illegal memory access was encountered"}
    from tests.bench.test_gpu_record_summary import load_summary

    assert load_summary().routing_line(report["engine"]["routing"]) == (
        "the routing pass failed: RuntimeError: CUDA error: an illegal memory access was encountered")


def test_bench_gpu_a_failing_run_with_jump_forward_the_other_way_keeps_the_constrained_runs(tmp_path, monkeypatch):
    """The constrained phase's last run, with jump-forward the other way from the engine's choice,
    is a setting no record has run on the GPU (on under decode graphs): its failure is recorded in
    `other_jump_forward`, and the three runs timed before it and the exit status stand."""
    crash = RuntimeError("CUDA error: operation not permitted when stream is capturing")
    status, report = bench_gpu_where(monkeypatch, tmp_path, "time_other_jump_forward", crash,
                                     "--output-tokens", "2", "--phase", "constrained", "--repeat-runs", "2")
    assert status == 0
    result = report["constrained"]
    assert result["other_jump_forward"] == {"error": f"RuntimeError: {crash}"}
    assert result["constrained_again"]["generated_tokens"] == result["constrained_real_stop"]["generated_tokens"]
    assert result["unconstrained_same_tokens"]["samples_per_s"] > 0
    from tests.bench.test_gpu_record_summary import load_summary

    assert f"the run with jump-forward the other way failed: RuntimeError: {crash}" in (
        load_summary().constrained_section(report, None))


def test_the_routing_pass_runs_decode_steps_eagerly_and_puts_the_decode_graphs_back():
    """A CUDA graph's replay runs no hooks, so the pass sets the engine's decode graphs aside (here a
    stand-in: the CPU engine has none) and counts the decode steps too."""
    from vlm_catalog.engine.config import EngineConfig
    from vlm_catalog.engine.generation_config import QWEN3_VL_SAMPLING
    from vlm_catalog.engine.llm_engine import LLMEngine
    from vlm_catalog.paths import DEFAULT_MODEL_DIR

    bench_gpu = load_bench_gpu()
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL_DIR))
    graphs = object()  # would fail if the pass replayed it
    engine.runner.graph_runner = graphs
    conversations = [[{"role": "user", "content": f"describe product {index}"}] for index in range(3)]
    summary = bench_gpu.routing_pass(engine, engine.runner.model, conversations, QWEN3_VL_SAMPLING)
    assert engine.runner.graph_runner is graphs
    assert summary["small_calls"]["calls"] == bench_gpu.ROUTING_TOKENS - 1  # every decode step counted
    engine.close()


def test_the_roofline_times_the_batch1_step_with_the_other_pdl_setting(monkeypatch):
    from kernels.pdl import PDL_ENV_VAR, pdl_requested

    bench_gpu = load_bench_gpu()
    seen = []

    def decode_step(model, device, batch, context, context_bound, repeats=10):
        seen.append(pdl_requested())  # the setting the step's graph is captured under
        if len(seen) == 3:
            raise RuntimeError("operation not permitted when stream is capturing")
        return {"seconds": 0.003, "kernels": {"total_us_per_step": 2900.0}}

    monkeypatch.setattr(bench_gpu, "measure_decode_batch", decode_step)
    monkeypatch.setattr(bench_gpu, "release_memory", lambda device: None)
    monkeypatch.delenv(PDL_ENV_VAR, raising=False)
    cuda = torch.device("cuda")
    assert bench_gpu.measure_decode_batch1_with_pdl(None, cuda, 8192, floor=0.002) == {
        "pdl": True, "seconds": 0.003, "over_floor": 1.5, "kernels": {"total_us_per_step": 2900.0}}
    monkeypatch.setenv(PDL_ENV_VAR, "1")  # the run's steps with PDL: this one without
    assert bench_gpu.measure_decode_batch1_with_pdl(None, cuda, 8192, floor=0.002)["pdl"] is False
    assert bench_gpu.measure_decode_batch1_with_pdl(None, cuda, 8192, floor=0.002) == {
        "pdl": False, "error": "RuntimeError: operation not permitted when stream is capturing"}
    assert seen == [True, False, False] and pdl_requested()  # the setting is back as it was


def test_the_roofline_times_the_pdl_step_without_its_weight_prefetches(monkeypatch):
    from kernels.dispatch import KERNELS_OFF_ENV_VAR, kernels_off
    from kernels.pdl import PDL_ENV_VAR, pdl_requested, prefetches_weights

    bench_gpu = load_bench_gpu()
    seen = []

    def decode_step(model, device, batch, context, context_bound, repeats=10):
        seen.append((pdl_requested(), prefetches_weights({"launch_pdl": True}), kernels_off()))
        return {"seconds": 0.003, "kernels": {"total_us_per_step": 2900.0}}

    monkeypatch.setattr(bench_gpu, "measure_decode_batch", decode_step)
    monkeypatch.setattr(bench_gpu, "release_memory", lambda device: None)
    monkeypatch.delenv(PDL_ENV_VAR, raising=False)
    monkeypatch.setenv(KERNELS_OFF_ENV_VAR, "skinny_linear")  # the run's own switches stay off
    assert bench_gpu.measure_decode_batch1_with_pdl_without_prefetch(None, torch.device("cuda"), 8192, 0.002) == {
        "pdl": True, "kernels_off": ["pdl_weight_prefetch", "skinny_linear"], "seconds": 0.003, "over_floor": 1.5,
        "kernels": {"total_us_per_step": 2900.0}}
    assert seen == [(True, False, {"pdl_weight_prefetch", "skinny_linear"})]
    assert not pdl_requested() and kernels_off() == {"skinny_linear"}  # the settings are back as they were


def test_the_roofline_keeps_its_numbers_when_the_large_decode_batch_does_not_fit(tmp_path, monkeypatch):
    bench_gpu = load_bench_gpu()
    measure = bench_gpu.measure_decode_batch

    def batch_1_only(model, device, batch, *args, **kwargs):
        if batch > 1:
            raise MemoryError("CUDA out of memory. Tried to allocate 6.25 GiB")
        return measure(model, device, batch, *args, **kwargs)

    monkeypatch.setattr(bench_gpu, "measure_decode_batch", batch_1_only)
    out = tmp_path / "bench_gpu.json"
    status = bench_gpu.main(["--tiny", "--device", "cpu", "--records", "1", "--phases", "roofline", "--json", str(out)])
    report = json.loads(out.read_text())
    assert status == 0
    roofline = report["roofline"]
    assert roofline["decode_large_batch"] == {"error": "MemoryError: CUDA out of memory. Tried to allocate 6.25 GiB"}
    assert roofline["prefill_tokens_per_s"] > 0 and roofline["decode_batch1_seconds"] > 0


def test_bench_gpu_model_phases_report_a_model_that_cannot_be_built(tmp_path, monkeypatch):
    status, report = bench_gpu_where(monkeypatch, tmp_path, "random_model", MemoryError("no room for the weights"),
                                     "--phases", "roofline,engine")
    assert status == 1
    for phase in ("roofline", "engine"):
        assert report[phase] == {"error": "building the model failed: MemoryError: no room for the weights"}


def test_bench_kernels_a_failing_group_keeps_the_other_rows(monkeypatch, capsys):
    pytest.importorskip("triton")
    bench_gpu = load_bench_gpu()
    bench_kernels = bench_gpu.load_bench_kernels()

    def crash(*args):
        raise RuntimeError("triton compile failed")

    monkeypatch.setitem(bench_kernels.BENCHMARK_GROUPS, "attention", crash)
    # the group after the crash runs too (moe and dense_fp8 are left out for time)
    report = bench_kernels.run_kernel_benchmarks("cpu", bench_kernels.TINY_SHAPES, groups=("attention", "elementwise"))
    assert report["errors"] == [{"group": "attention", "error": "RuntimeError: triton compile failed"}]
    assert {"rms_norm", "vision_rotary", "silu_and_mul"} <= {row["name"] for row in report["rows"]}
    bench_kernels.print_table(report)
    assert "FAILED attention: RuntimeError: triton compile failed" in capsys.readouterr().out


def test_bench_gpu_refuses_a_negative_warmup_and_no_runs(capsys):
    with pytest.raises(SystemExit):
        load_bench_gpu().main(["--tiny", "--device", "cpu", "--phase", "engine", "--warmup-records", "-1"])
    assert "--warmup-records must be >= 0 (0: no warm-up), got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_bench_gpu().main(["--tiny", "--device", "cpu", "--phase", "engine", "--repeat-runs", "0"])
    assert "--repeat-runs must be >= 1 (1: each run once), got 0" in capsys.readouterr().err


def test_the_graph_timer_takes_the_flush_off_each_call():
    """graph_ms_per_call: (flush, fn) x n against flush x n, per call, n from a one-call graph's
    estimate. Here a "graph" is the body itself and its replay is timed by a simulated clock that
    fn moves 20 ms and flush 10 ms (CUDA graphs need a GPU; with sleeps and the wall clock, a
    loaded machine's oversleeping failed the test: 27.9 ms)."""
    bench_kernels = load_bench_gpu().load_bench_kernels()
    calls, clock = [], [0.0]

    def fn():
        calls.append("fn")
        clock[0] += 20.0

    def flush():
        calls.append("flush")
        clock[0] += 10.0

    def replay_ms(body):
        start = clock[0]
        body()
        return clock[0] - start

    ms = bench_kernels.graph_ms_per_call(fn, capture=lambda body: body, replay_ms=replay_ms, flush=flush,
                                         target_ms=55.0)
    assert ms == pytest.approx(20.0)  # the 20 ms call, without the 10 ms flush before it (30 ms with it)
    # compiled outside the capture, one call to estimate, then ceil(55 / 20-27) = 3 calls per graph
    assert calls == ["fn", "fn"] + ["flush", "fn"] * 3 + ["flush"] * 3
    calls.clear()
    bench_kernels.graph_ms_per_call(fn, capture=lambda body: body, replay_ms=replay_ms, flush=flush, target_ms=1.0)
    assert calls.count("fn") == 3  # a call longer than the target: one per graph
    calls.clear()
    bench_kernels.graph_ms_per_call(fn, capture=lambda body: body, replay_ms=replay_ms, flush=flush, max_calls=2,
                                    target_ms=1000.0)
    assert calls.count("fn") == 4  # at most max_calls per graph
    assert bench_kernels.make_graph_timer(torch.device("cpu"))(lambda: None) >= 0  # CPU: the wall clock


def test_the_host_time_is_the_launches_without_waiting_for_the_device():
    """host_ms_per_call: the device is waited for before and after the calls, never between them,
    and the clock runs over the calls alone."""
    bench_kernels = load_bench_gpu().load_bench_kernels()
    events, now = [], [0.0]

    def fn():
        events.append("call")
        now[0] += 0.003  # each call's host work: 3 ms on the fake clock

    def synchronize():
        events.append("sync")
        now[0] += 1.0  # the device's backlog: outside the timed span

    ms = bench_kernels.host_ms_per_call(fn, synchronize=synchronize, calls=4, clock=lambda: now[0])
    assert ms == pytest.approx(3.0)
    assert events == ["call", "sync"] + ["call"] * 4 + ["sync"]  # a warm-up call first


def test_a_call_that_cannot_be_captured_is_timed_host_launched_and_said_so(capsys):
    """A GraphTimer's timing is a `Timing` with the host's time beside it; where capturing fails it
    is do_bench's, reported once per kind of failure, and the row that takes it says so."""
    bench_kernels = load_bench_gpu().load_bench_kernels()

    def capture_fails(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    host_calls = []

    def host(fn, calls):
        host_calls.append(calls)
        return 0.04

    timer = bench_kernels.GraphTimer(capture_fails, lambda fn: 1.5, host=host)
    fallback = timer(lambda: None)
    assert fallback == 1.5 and timer.fell_back and not fallback.in_graph and fallback.host_ms == 0.04
    assert bench_kernels.graph_note(timer) == "host-launched (graph capture failed)"
    timer(lambda: None)
    assert capsys.readouterr().err.count("graph timing failed") == 1  # reported once per kind
    timer.timed = lambda fn: 0.25
    in_graph = timer(lambda: None)
    assert in_graph == 0.25 and in_graph.in_graph and not timer.fell_back
    assert host_calls == [14, 14, 50]  # ~20 ms of device time: 14 calls of 1.5 ms, the most (50) of 0.25
    assert bench_kernels.graph_note(timer) == "device time in a CUDA graph, L2 cold"

    row = bench_kernels.Row("op", "T=1", in_graph, "reference", fallback, "-", note="sets X")
    assert row.note == "sets X; baseline: host-launched (graph capture failed)"
    assert row.host_ms == 0.04 and type(row.triton_ms) is float and type(row.baseline_ms) is float
    assert json.loads(json.dumps(dataclasses.asdict(row)))["host_ms"] == 0.04
    copied = pickle.loads(pickle.dumps(fallback))  # as a worker process would send it back
    assert (copied, copied.in_graph, copied.host_ms) == (1.5, False, 0.04)
    both_in_graphs = bench_kernels.Row("op", "T=1", in_graph, "reference", in_graph, "-")
    assert both_in_graphs.note == ""  # the table's default needs no note
    plain = bench_kernels.Row("op", "T=1", 2.0, "reference", 3.0, "-")  # the CPU's wall clock
    assert plain.note == "" and plain.host_ms is None


class RecordingTimers:
    """A host timer and a graph timer (a `GraphTimer` whose capture always works) that run
    nothing and note which of them timed which call: (timer, the call's function name, its first
    argument's row count)."""

    def __init__(self, bench_kernels) -> None:
        self.calls: list[tuple[str, str, int]] = []
        self.host = partial(self.record, "host", 2.0)
        self.graph = bench_kernels.GraphTimer(partial(self.record, "graph", 1.0), self.host)

    def record(self, timer: str, ms: float, fn) -> float:
        rows = next((arg.shape[0] for arg in getattr(fn, "args", ()) if isinstance(arg, torch.Tensor)), -1)
        self.calls.append((timer, getattr(fn, "func", fn).__name__, rows))
        return ms

    def timers_of(self, name: str, rows: int) -> set[str]:
        return {timer for timer, called, count in self.calls if called == name and count == rows}


def test_every_row_is_timed_by_the_one_timer_and_a_fallback_shows_in_its_note(triton_device):
    """The rows of every size take the one timer they are given (a GPU's: device time in graphs);
    the per-expert loop, which reads its counts on the host, cannot be captured, and the rows
    that compare against it say their baseline was host-launched."""
    bench_kernels = load_bench_gpu().load_bench_kernels()
    shapes = bench_kernels.TINY_SHAPES  # MoE rows at T = 4 and 16
    timers = RecordingTimers(bench_kernels)

    def capture(fn):
        if getattr(fn, "func", fn).__name__ == "fused_moe_reference":
            raise RuntimeError("operation not permitted when stream is capturing")
        return timers.record("graph", 1.0, fn)

    timer = bench_kernels.GraphTimer(capture, timers.host, host=lambda fn, calls: 0.5)
    rows = bench_kernels.bench_moe(shapes, torch.bfloat16, triton_device, timer)
    assert timers.timers_of("fused_moe_triton", 4) == timers.timers_of("fused_moe_triton", 16) == {"graph"}
    assert timers.timers_of("fused_moe_reference", 4) == timers.timers_of("fused_moe_reference", 16) == {"host"}
    assert timers.timers_of("fused_moe_grouped_gemm", 16) == {"graph"}  # prefill-sized, in a graph too
    by_name = {(row.name, row.shape.split()[0]): row for row in rows}
    for size in ("T=4", "T=16"):
        loop_row = by_name[("fused_moe", size)]
        assert loop_row.note == "baseline: host-launched (graph capture failed)"
        assert (loop_row.triton_ms, loop_row.baseline_ms, loop_row.host_ms) == (1.0, 2.0, 0.5)
        assert by_name[("fused_moe[fp8 w8a8, per-channel]", size)].note == ""
    assert all(row.host_ms == 0.5 for row in rows if row.triton_ms == 1.0)
    routing = [row for row in rows if row.name == "route_topk_and_align[one launch]"]
    assert routing and all(row.triton_ms == row.baseline_ms == 1.0 for row in routing)
    assert all(row.note.startswith("sets ROUTE_ALIGN_MAX_TOKENS") for row in routing)

    norm_rows = bench_kernels.bench_elementwise(shapes, torch.bfloat16, triton_device, timer)
    norms = {row.shape: row for row in norm_rows if row.name == "fused_sum_add_rms_norm"}
    assert {norms["T=1 K=8 H=64"].baseline_ms, norms[f"T={shapes.num_tokens} K=8 H=64"].baseline_ms} == {1.0}


def test_tune_moe_times_decode_buckets_in_graphs(triton_device, monkeypatch, capsys):
    """The MoE tuner picks decode-sized buckets' tiles by their device time in a graph (at T=1 on
    the H100 every candidate took the host's ~0.24 ms when launched from the host), and
    prefill-sized ones host-launched; a config that cannot run is skipped before any timing."""
    bench_kernels = load_bench_gpu().load_bench_kernels()
    timers = RecordingTimers(bench_kernels)
    monkeypatch.setattr(bench_kernels, "make_timer", lambda device: timers.host)
    host_measured = []

    def make_graph_timer(device, measure_host=True):
        host_measured.append(measure_host)
        return timers.graph

    monkeypatch.setattr(bench_kernels, "make_graph_timer", make_graph_timer)
    best = bench_kernels.tune_moe(triton_device, bench_kernels.TINY_SHAPES, buckets=[4, 16], max_candidates=2)
    assert host_measured == [False]  # the tuner compares device times only
    assert timers.timers_of("fused_moe_triton", 4) == {"graph"}
    assert timers.timers_of("fused_moe_triton", 16) == {"host"}
    assert best[4][0] == 1.0 and best[16][0] == 2.0
    out = capsys.readouterr().out
    assert "# T=4: 1.0000 ms (of 2 configs, device time in a CUDA graph, L2 cold)" in out
    assert "# T=16: 2.0000 ms (of 2 configs), against 2.0000 ms for the config in effect\n" in out


def test_the_attention_rows_time_fa3_where_it_runs(triton_device, fake_fa3, monkeypatch):
    """With FlashAttention 3 loadable (a stand-in here), the attention group adds its rows beside
    torch's varlen kernel: the vision images in one call, whole prompts, and the engine's prefill
    call; each through FA3 (its stand-in records the calls), each noting the switch it sets."""
    from kernels import flash_varlen
    from tests.kernels.flash_fakes import FakeFa3Varlen, FakeFlashVarlen

    torch_call = FakeFlashVarlen()
    monkeypatch.setattr(flash_varlen, "torch_varlen_function", lambda: torch_call)
    fa3 = fake_fa3(FakeFa3Varlen())
    bench_kernels = load_bench_gpu().load_bench_kernels()
    rows = bench_kernels.bench_attention(bench_kernels.TINY_SHAPES, torch.bfloat16, triton_device,
                                         bench_kernels.make_timer(triton_device))
    fa3_rows = {row.name: row for row in rows if "fa3" in row.name}
    assert set(fa3_rows) == {"varlen_attention[fa3]", "paged_prefill_attention[fresh, fa3]",
                             "paged_prefill_attention[fa3]"}
    assert all(row.note == "sets VLM_CATALOG_FLASH_VARLEN's default" and row.triton_ms > 0 for row in fa3_rows.values())
    assert {call["causal"] for call in fa3.calls} == {True, False}
    # the [flash varlen] rows stay torch's FlashAttention 2, though the default would take FA3 here
    flash_rows = [row for row in rows if "flash varlen" in row.name]
    assert flash_rows and len(torch_call.calls) >= len(flash_rows)
    assert os.environ.get("VLM_CATALOG_FLASH_VARLEN") is None  # set for the rows only


@pytest.mark.gpu
def test_gpu_graph_timer_times_a_syncing_op_host_launched_and_goes_on(cuda_device):
    """A call that waits on the device is refused before capture (do_bench times it), and the
    process keeps its stream and its random generator: on the H200 of 2026-11-27 a failed capture
    left every later torch.randn raising, and the kernels phase lost all its rows."""
    bench_kernels = load_bench_gpu().load_bench_kernels()
    timer = bench_kernels.make_graph_timer(cuda_device, measure_host=False)
    x = torch.randn(1 << 16, device=cuda_device)
    assert timer(lambda: x.mul(2)).in_graph
    synced = timer(lambda: x[x > 0].sum())  # a boolean-mask index: nonzero waits on the device
    assert not synced.in_graph and synced > 0
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.randn(8, device=cuda_device)
    assert timer(lambda: x.mul(2)).in_graph


@pytest.mark.gpu
def test_gpu_failed_capture_gives_back_the_stream_and_the_generator(cuda_device):
    bench_kernels = load_bench_gpu().load_bench_kernels()
    x = torch.randn(1 << 10, device=cuda_device)
    caller_stream = torch.cuda.current_stream()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError):
        try:
            with torch.cuda.graph(graph):
                torch.randn(4, device=cuda_device)  # the generator enters capture mode
                x.nonzero()  # waits on the device: the capture fails
        except RuntimeError:
            bench_kernels._recover_from_failed_capture(caller_stream)
            raise
    assert torch.cuda.current_stream() == caller_stream
    assert torch.randn(8, device=cuda_device).isfinite().all()


def test_quantize_model_frees_each_layers_experts_without_a_collection(tmp_path, monkeypatch):
    """The FP8 phases quantize the experts one layer at a time. Each layer's bf16 weights are freed
    by their reference counts as `quantize_` returns (no cycle holds them), so `quantize_model`
    collects once at the end instead of once per layer: a collection took 0.2-0.4 s of host time,
    and the 30B-A3B model has 48 layers."""
    import copy
    import gc
    import weakref

    from tests.bench.test_random_model import SHAPES
    from vlm_catalog.bench.random_model import benchmark_checkpoint_dir, random_model
    from vlm_catalog.model.text import Fp8Linear

    bench_gpu = load_bench_gpu()
    shapes = copy.deepcopy(SHAPES)
    shapes["text_config"]["num_hidden_layers"] = 3
    model = random_model(benchmark_checkpoint_dir(tmp_path / "checkpoint", shapes), "cpu", torch.float32, seed=1)
    decoder = model.language_model
    unquantized = [weakref.ref(experts.gate_up_proj) for experts in decoder.moe_experts()]
    collections = []
    monkeypatch.setattr(bench_gpu, "release_memory", collections.append)
    gc.disable()
    try:
        block, dense_block = bench_gpu.quantize_model(model, torch.device("cpu"), fp8_activations=True,
                                                      per_channel=True)
        assert [ref() for ref in unquantized] == [None] * 3  # freed with no collection
    finally:
        gc.enable()
    assert collections == [torch.device("cpu")]  # one, after every layer
    assert all(experts.fp8_block == block.block and experts.fp8_activations for experts in decoder.moe_experts())
    assert all(isinstance(getattr(module, name), Fp8Linear) and getattr(module, name).block == dense_block.block
               for module, name in decoder.dense_projections())


@pytest.mark.parametrize("tied", [False, True])
def test_the_decode_floor_counts_what_a_decode_token_reads(tmp_path, tied):
    """Every text weight but the embedding table (one row of it), top-k of each MoE layer's
    experts, and the whole of lm_head: also when it is the embedding table (tied), since the
    timed step computes the logits."""
    from tests.model.helpers import build_checkpoint
    from vlm_catalog.model.loader import load_model
    from vlm_catalog.model.tiny_checkpoint import build_tokenizer

    model = load_model(build_checkpoint(tmp_path / "tiny", build_tokenizer(1000), tie_word_embeddings=tied),
                       dtype=torch.float32, device="cpu")
    text = model.config.text
    layers = model.language_model.layers
    experts = sum(p.numel() for layer in layers for name, p in layer.named_parameters() if ".experts." in f".{name}")
    others = sum(p.numel() for layer in layers for name, p in layer.named_parameters() if ".experts." not in f".{name}")
    final_norm = model.language_model.norm.weight.numel()
    expected = (experts * text.num_experts_per_tok // text.num_experts + others + final_norm
                + text.hidden_size + text.vocab_size * text.hidden_size)
    bench_gpu = load_bench_gpu()
    assert bench_gpu.active_parameters(model) == expected
    assert bench_gpu.active_weight_bytes(model) == 4 * expected  # float32
