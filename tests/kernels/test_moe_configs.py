"""MoE block-size table: bucket choice, lookups, the heuristic, the paste format."""

from __future__ import annotations

import torch

from kernels.dispatch import FP8_FAST_ACCUMULATION_ENV_VAR
from kernels.fp8 import per_channel_block
from kernels.moe.configs import (
    CHANNEL_SUFFIX,
    MAX_SHARED_MEMORY_BYTES,
    MOE_CONFIGS,
    TOKEN_BUCKETS,
    W8A8_SUFFIX,
    MoeKernelConfig,
    as_moe_config,
    fit_shared_memory,
    format_config_entry,
    gate_up_shared_memory_bytes,
    get_moe_config,
    heuristic_moe_config,
    token_bucket,
)
from kernels.moe.fused_moe import asynchronous_k_loops, moe_gemm_config, per_channel_experts


def test_token_bucket_is_the_smallest_bucket_at_or_above():
    assert token_bucket(1) == 1
    assert token_bucket(3) == 4
    assert token_bucket(256) == 256
    assert token_bucket(257) == 512
    assert token_bucket(10**6) == TOKEN_BUCKETS[-1]


def test_table_covers_the_model_shapes_and_marks_only_the_measured_entries_tuned():
    for bucket in TOKEN_BUCKETS:
        assert (128, 2048, 768, "bfloat16", bucket) in MOE_CONFIGS
        assert (128, 2048, 768, "float8_e4m3fn", bucket) in MOE_CONFIGS  # FP8 experts: entries of their own
    tuned = sorted(key for key, config in MOE_CONFIGS.items() if config.tuned)
    # the H100 run of 2026-11-25 tuned the bf16 30B-A3B experts at these buckets, nothing else
    assert tuned == [(128, 2048, 768, "bfloat16", bucket) for bucket in (1, 64, 256, 4096, 16384)]


def test_shared_memory_estimate_matches_what_an_h100_reported():
    # BLOCK_M 32, BLOCK_N 64, BLOCK_K 128, 4 stages in float32: "Required: 245760" on the H100
    assert gate_up_shared_memory_bytes(MoeKernelConfig(32, 64, 128, 4, 4, 4), element_bytes=4) == 245760


def test_every_config_fits_shared_memory_for_its_element_size():
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        for num_experts, hidden, intermediate in ((128, 2048, 768), (128, 4096, 1536), (4, 64, 32)):
            for bucket in TOKEN_BUCKETS:
                config = get_moe_config(bucket, num_experts, hidden, intermediate, dtype)
                assert gate_up_shared_memory_bytes(config, dtype.itemsize) <= MAX_SHARED_MEMORY_BYTES, (dtype, config)


def test_fit_shared_memory_drops_stages_then_block_k_and_keeps_what_fits():
    too_big = MoeKernelConfig(32, 64, 128, 4, 4, 4)  # 245,760 B in float32
    assert fit_shared_memory(too_big, 4) == MoeKernelConfig(32, 64, 128, 4, 4, 3)  # 163,840 B
    assert fit_shared_memory(too_big, 2) is too_big  # 2-byte weights: it fits as written
    wide = MoeKernelConfig(128, 256, 128, 1, 8, 2)  # one stage of 640 x 128 float32 elements: 327,680 B
    assert fit_shared_memory(wide, 4) == MoeKernelConfig(128, 256, 64, 1, 8, 2)  # 163,840 B
    # the tiny test model (8 experts, top-2) in float32, decode batch 96 of a CUDA-graph capture:
    # 24 rows per expert take the 4-stage heuristic, whose capture failed on the H100
    assert heuristic_moe_config(96, 8, 2) == MoeKernelConfig(32, 64, 128, 4, 4, 4)
    assert get_moe_config(96, 8, 64, 32, torch.float32, top_k=2) == MoeKernelConfig(32, 64, 128, 4, 4, 3)


def test_fp8_experts_look_up_their_own_entries():
    key = (128, 2048, 768, "float8_e4m3fn", 256)
    original, marker = MOE_CONFIGS[key], MoeKernelConfig(16, 64, 128, 1, 4, 2, tuned=True)
    MOE_CONFIGS[key] = marker
    try:
        assert get_moe_config(200, 128, 2048, 768, torch.float8_e4m3fn) is marker
        assert get_moe_config(200, 128, 2048, 768, torch.bfloat16) is not marker
    finally:
        MOE_CONFIGS[key] = original


def test_w8a8_looks_up_entries_of_its_own(monkeypatch):
    """FP8 activations meeting FP8 weights have their own tiles ('float8_e4m3fn_w8a8'), found by
    the GEMMs and by the model's routing alike (the layouts must agree)."""
    marker = MoeKernelConfig(64, 128, 128, 1, 4, 3, tuned=True)
    monkeypatch.setitem(MOE_CONFIGS, (128, 2048, 768, "float8_e4m3fn" + W8A8_SUFFIX, 256), marker)
    assert get_moe_config(200, 128, 2048, 768, torch.float8_e4m3fn, fp8_activations=True) is marker
    assert get_moe_config(200, 128, 2048, 768, torch.float8_e4m3fn) is not marker  # W8A16
    w13 = torch.empty(128, 2 * 768, 2048, dtype=torch.float8_e4m3fn)
    assert moe_gemm_config(200, w13, 8, fp8_activations=True) is marker
    line = format_config_entry(128, 2048, 768, torch.float8_e4m3fn, 256, marker, fp8_activations=True)
    assert eval(line.strip().rstrip(",").split(": ", 1)[0]) == (128, 2048, 768, "float8_e4m3fn_w8a8", 256)
    # every shape with FP8 entries has W8A8 ones too, and per-channel W8A8 ones
    fp8_keys = {key[:3] + key[4:] for key in MOE_CONFIGS if key[3] == "float8_e4m3fn"}
    assert fp8_keys == {key[:3] + key[4:] for key in MOE_CONFIGS if key[3] == "float8_e4m3fn" + W8A8_SUFFIX}
    assert fp8_keys == {key[:3] + key[4:] for key in MOE_CONFIGS
                        if key[3] == "float8_e4m3fn" + W8A8_SUFFIX + CHANNEL_SUFFIX}


def test_per_channel_experts_look_up_entries_of_their_own(monkeypatch):
    """Per-channel FP8 experts (one scale row spanning H and I: the kernels scale after their K
    loops) whose loops do not wait per K step have their own tiles, keyed
    'float8_e4m3fn_w8a8_channel'; 128 x 128 blocks do not. With FP8 activations that is only
    under fast accumulation: summed into float32 every step, they take the block-scaled tiles."""
    marker = MoeKernelConfig(128, 128, 128, 8, 8, 3, tuned=True)
    block_marker = MoeKernelConfig(128, 64, 128, 8, 8, 3, tuned=True)
    key_dtype = "float8_e4m3fn" + W8A8_SUFFIX + CHANNEL_SUFFIX
    monkeypatch.setitem(MOE_CONFIGS, (128, 2048, 768, key_dtype, 4096), marker)
    monkeypatch.setitem(MOE_CONFIGS, (128, 2048, 768, "float8_e4m3fn" + W8A8_SUFFIX, 4096), block_marker)
    monkeypatch.setenv(FP8_FAST_ACCUMULATION_ENV_VAR, "1")
    w13 = torch.empty(128, 2 * 768, 2048, dtype=torch.float8_e4m3fn)
    assert per_channel_experts(w13, per_channel_block(2048, 768))
    assert not per_channel_experts(w13, (128, 128)) and not per_channel_experts(w13, None)
    assert not per_channel_experts(w13, (1, 1024))  # spans I (768) but not H (2048)
    assert per_channel_experts(w13, (128, 2048))  # rows of 128, but both loops scale after: the same tiles
    assert moe_gemm_config(4000, w13, 8, fp8_activations=True, block_shape=per_channel_block(2048, 768)) is marker
    assert moe_gemm_config(4000, w13, 8, fp8_activations=True, block_shape=(128, 128)) is block_marker
    monkeypatch.setenv(FP8_FAST_ACCUMULATION_ENV_VAR, "0")
    assert moe_gemm_config(4000, w13, 8, fp8_activations=True, block_shape=per_channel_block(2048, 768)) \
        is block_marker
    assert not asynchronous_k_loops(w13, per_channel_block(2048, 768), fp8_activations=True)
    assert asynchronous_k_loops(w13, per_channel_block(2048, 768), fp8_activations=False)  # bf16 dots
    assert not asynchronous_k_loops(w13, (128, 128), fp8_activations=False)
    line = format_config_entry(128, 2048, 768, torch.float8_e4m3fn, 4096, marker, fp8_activations=True,
                               per_channel=True)
    assert eval(line.strip().rstrip(",").split(": ", 1)[0]) == (128, 2048, 768, key_dtype, 4096)


def test_lookup_uses_the_table_then_the_heuristic():
    marker = MoeKernelConfig(16, 32, 64, 1, 4, 2, tuned=True)
    key = (128, 2048, 768, "bfloat16", 512)
    original = MOE_CONFIGS[key]
    MOE_CONFIGS[key] = marker
    try:
        assert get_moe_config(300, 128, 2048, 768, torch.bfloat16) is marker
    finally:
        MOE_CONFIGS[key] = original
    assert get_moe_config(300, 7, 96, 40, torch.float32, top_k=2) == heuristic_moe_config(300, 7, 2)


def test_heuristic_grows_block_m_with_rows_per_expert():
    block_ms = [heuristic_moe_config(t, 128, 8).block_size_m for t in (1, 256, 1024, 4096, 16384)]
    assert block_ms == sorted(block_ms) and block_ms[0] == 16 and block_ms[-1] > 16


def test_one_row_block_holds_most_experts_rows_at_decode_batches():
    """A memory-bound GEMM reads an expert's weights once per row block: at 16 rows per expert on
    average (256 tokens) a 16-row block would leave about 4 experts in 10 with a second one."""
    generator = torch.Generator().manual_seed(0)
    for tokens in (64, 128, 256):
        block_m = heuristic_moe_config(tokens, 128, 8).block_size_m
        ids = torch.stack([torch.randperm(128, generator=generator)[:8] for _ in range(tokens)])  # [T, 8] distinct
        rows = torch.bincount(ids.flatten(), minlength=128)  # [E]
        second_blocks = int((rows > block_m).sum())
        assert second_blocks <= 128 // 20, (tokens, block_m, rows.max())
    assert heuristic_moe_config(128, 128, 8).block_size_m == 16 and heuristic_moe_config(256, 128, 8).block_size_m == 32


def test_formatted_entry_round_trips():
    config = MoeKernelConfig(32, 64, 128, 4, 4, 3, tuned=True)
    line = format_config_entry(128, 2048, 768, torch.bfloat16, 64, config)
    key_text, value_text = line.strip().rstrip(",").split(": ", 1)
    assert eval(key_text) == (128, 2048, 768, "bfloat16", 64)
    assert eval(value_text, {"MoeKernelConfig": MoeKernelConfig}) == config


def test_config_from_mapping():
    assert as_moe_config(
        {
            "block_size_m": 16,
            "block_size_n": 32,
            "block_size_k": 64,
            "group_size_m": 1,
            "num_warps": 4,
            "num_stages": 2,
        }
    ) == MoeKernelConfig(16, 32, 64, 1, 4, 2)


def test_fp8_weights_step_through_k_one_128_wide_scale_block_at_a_time():
    for tokens in (1, 256, 1024, 4096, 16384):
        fp8 = heuristic_moe_config(tokens, 128, 8, weight_bytes=1)
        bf16 = heuristic_moe_config(tokens, 128, 8)
        assert fp8.block_size_k == 128  # the same bytes per stage as a 16-bit tile's 64
        assert (fp8.block_size_m, fp8.block_size_n) == (bf16.block_size_m, bf16.block_size_n)
    assert heuristic_moe_config(16384, 128, 8).block_size_k == 64
    # the untuned FP8 entries (block-scaled W8A16 and W8A8) and an FP8 shape without entries
    for fp8_activations in (False, True):
        for tokens in (1024, 8192, 16384):
            config = get_moe_config(tokens, 128, 2048, 768, torch.float8_e4m3fn, fp8_activations=fp8_activations)
            assert config.block_size_k == 128, (tokens, fp8_activations, config)
    assert get_moe_config(16384, 64, 1024, 512, torch.float8_e4m3fn).block_size_k == 128
