"""MoE block-size table: bucket choice, lookups, the heuristic, the paste format."""

from __future__ import annotations

import torch

from kernels.moe.configs import (
    MOE_CONFIGS,
    TOKEN_BUCKETS,
    MoeKernelConfig,
    as_moe_config,
    format_config_entry,
    get_moe_config,
    heuristic_moe_config,
    token_bucket,
)


def test_token_bucket_is_the_smallest_bucket_at_or_above():
    assert token_bucket(1) == 1
    assert token_bucket(3) == 4
    assert token_bucket(256) == 256
    assert token_bucket(257) == 512
    assert token_bucket(10**6) == TOKEN_BUCKETS[-1]


def test_table_covers_the_model_shapes_and_is_marked_untuned():
    for bucket in TOKEN_BUCKETS:
        assert (128, 2048, 768, "bfloat16", bucket) in MOE_CONFIGS
        assert (128, 2048, 768, "float8_e4m3fn", bucket) in MOE_CONFIGS  # FP8 experts: entries of their own
    assert not any(config.tuned for config in MOE_CONFIGS.values())


def test_fp8_experts_look_up_their_own_entries():
    key = (128, 2048, 768, "float8_e4m3fn", 256)
    original, marker = MOE_CONFIGS[key], MoeKernelConfig(16, 64, 128, 1, 4, 2, tuned=True)
    MOE_CONFIGS[key] = marker
    try:
        assert get_moe_config(200, 128, 2048, 768, torch.float8_e4m3fn) is marker
        assert get_moe_config(200, 128, 2048, 768, torch.bfloat16) is not marker
    finally:
        MOE_CONFIGS[key] = original


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
