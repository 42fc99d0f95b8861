"""Decode CUDA graphs: padding to a bucket changes nothing (CPU, no capture), a failed capture
leaves the engine decoding eagerly, and replay equals eager (GPU)."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import arrival_counters as counters_module
from kernels import pdl
from vlm_catalog.engine.cuda_graphs import DecodeGraphRunner, default_buckets
from vlm_catalog.engine.paged_attention import (
    DecodeBatch,
    PagedAttention,
    PagedAttentionMetadata,
    PrefillBatch,
    allocate_kv_caches,
)
from vlm_catalog.model.loader import load_model

BLOCK = 4
REPO_ROOT = Path(__file__).resolve().parents[2]


def prefilled(model, device, num_sequences=5, prompt_len=9):
    """KV caches holding `num_sequences` prompts, and each sequence's block table."""
    text = model.config.text
    caches = allocate_kv_caches(text.num_layers, 64, BLOCK, text.num_kv_heads, text.head_dim, model.dtype, device)
    tables = [list(range(s * 4, s * 4 + 4)) for s in range(num_sequences)]  # 4 blocks = 16 tokens each
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 200, (num_sequences * prompt_len,), generator=generator).to(device)
    positions = torch.arange(prompt_len).repeat(num_sequences).unsqueeze(0).expand(3, -1).to(device)
    slots = torch.cat([torch.tensor([t[i // BLOCK] * BLOCK + i % BLOCK for i in range(prompt_len)]) for t in tables])
    table_tensor = torch.tensor(tables, dtype=torch.int32, device=device)
    prefill = PrefillBatch(
        slot_mapping=slots.to(device), block_tables=table_tensor,
        cu_seqlens_q=torch.arange(0, (num_sequences + 1) * prompt_len, prompt_len, dtype=torch.int32, device=device),
        context_lens=torch.full((num_sequences,), prompt_len, dtype=torch.int32, device=device),
        max_query_len=prompt_len,
    )
    model(ids, positions, PagedAttention(caches, PagedAttentionMetadata(decode=None, prefill=prefill)))
    return caches, table_tensor


def decode_inputs(num_sequences, prompt_len, device, tables):
    ids = torch.arange(11, 11 + num_sequences, device=device)
    positions = torch.full((3, num_sequences), prompt_len, device=device)
    slots = torch.tensor([int(tables[s, prompt_len // BLOCK]) * BLOCK + prompt_len % BLOCK for s in range(num_sequences)], device=device)
    lens = torch.full((num_sequences,), prompt_len + 1, dtype=torch.int32, device=device)
    return ids, positions, slots, lens


def clone(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


def check_graph_runner_equals_eager(checkpoint, device, capture):
    model = load_model(checkpoint, device=device)
    caches, tables = prefilled(model, device)
    ids, positions, slots, lens = decode_inputs(5, 9, device, tables)
    eager_caches = clone(caches)
    metadata = PagedAttentionMetadata(decode=DecodeBatch(slots, tables, lens, max_context_len=10), prefill=None)
    expected = model(ids, positions, PagedAttention(eager_caches, metadata))

    runner = DecodeGraphRunner(model, caches, max_batch=8, max_blocks_per_sequence=16, max_context_len=64,
                               capture=capture, buckets=[2, 8])
    runner.capture()
    before = clone(caches)
    got = runner.run(ids, positions, slots, tables, lens)  # 5 sequences padded to the bucket of 8
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for (k, v), (k_expected, v_expected), (k_before, _) in zip(caches, eager_caches, before):
        # same writes (to float rounding: matmuls over 8 rows round differently than over 5)
        torch.testing.assert_close(k, k_expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v_expected, rtol=1e-5, atol=1e-5)
        changed = (k != k_before).flatten(1).any(dim=1).nonzero().flatten().tolist()
        assert set(changed) <= {int(tables[s, 9 // BLOCK]) for s in range(5)}  # padding rows wrote nothing
    return runner


def test_padding_to_a_bucket_changes_nothing_on_cpu(engine_checkpoint):
    runner = check_graph_runner_equals_eager(engine_checkpoint, torch.device("cpu"), capture=False)
    assert runner.graphs == {}  # nothing captured on CPU
    assert runner.bucket(5) == 8 and runner.bucket(1) == 2


def test_a_failed_capture_keeps_no_graph_and_decodes_eagerly(engine_checkpoint, monkeypatch, caplog):
    """A capture that fails half-way (here after the first bucket) drops what it captured, says
    why, and `run` still answers, eagerly."""
    model = load_model(engine_checkpoint, device=torch.device("cpu"))
    caches, tables = prefilled(model, torch.device("cpu"))
    runner = DecodeGraphRunner(model, caches, max_batch=8, max_blocks_per_sequence=16, max_context_len=64,
                               capture=True, buckets=[2, 8])

    def capture_failing_on_the_second_bucket():
        runner.graphs[8], runner.outputs[8] = object(), torch.zeros(8, 4)  # what a first bucket leaves
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(runner, "_capture", capture_failing_on_the_second_bucket)
    with caplog.at_level(logging.WARNING, logger="vlm_catalog.engine.cuda_graphs"):
        assert runner.capture() is False
    assert runner.graphs == {} and runner.outputs == {}
    assert runner.capture_failure == "RuntimeError: CUDA error: operation not permitted when stream is capturing"
    assert "decode steps run eagerly" in caplog.text and "operation not permitted" in caplog.text
    ids, positions, slots, lens = decode_inputs(5, 9, torch.device("cpu"), tables)
    assert runner.run(ids, positions, slots, tables, lens).shape == (5, model.config.text.hidden_size)


def test_a_failed_start_up_check_reaches_the_graphs(engine_checkpoint, monkeypatch, caplog):
    """The graphs keep what their kernels chose at capture, so the check of the kernels finishing
    in their last program (kernels/arrival_counters.py) runs before it: where it fails, no counters
    are served while the graphs are captured, and the decode merge and the routing take their two
    launches in every replayed step too (the check once ran only after the capture)."""
    model = load_model(engine_checkpoint, device=torch.device("cpu"))
    caches, _ = prefilled(model, torch.device("cpu"))
    runner = DecodeGraphRunner(model, caches, max_batch=8, max_blocks_per_sequence=16, max_context_len=64,
                               capture=True, buckets=[2, 8])
    monkeypatch.setenv("VLM_CATALOG_KERNELS", "triton")  # the check runs where the Triton kernels do
    monkeypatch.setattr(counters_module, "_trusted", {})  # no verdict yet on this device
    monkeypatch.setattr(counters_module, "_merge_problem", lambda device: "the in-place merge differs")
    served_at_capture = []
    monkeypatch.setattr(runner, "_capture", lambda: served_at_capture.append(
        counters_module.arrival_counters(model.device, 1)))
    with caplog.at_level(logging.WARNING, logger="kernels.arrival_counters"):
        assert runner.capture() is True
    assert served_at_capture == [None]
    assert "the in-place merge differs" in caplog.text


def test_default_buckets():
    assert default_buckets(256)[:6] == [1, 2, 4, 8, 16, 24] and default_buckets(256)[-1] == 256
    assert default_buckets(20) == [1, 2, 4, 8, 16, 20]


@pytest.mark.gpu
def test_graph_replay_equals_eager_on_gpu(engine_checkpoint):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    runner = check_graph_runner_equals_eager(engine_checkpoint, torch.device("cuda"), capture=True)
    assert set(runner.graphs) == {2, 8}


@pytest.mark.gpu
def test_graph_replay_equals_eager_on_gpu_with_programmatic_dependent_launch(engine_checkpoint):
    # the same checks with every Triton kernel launched with PDL (kernels/pdl.py), in the prefill,
    # the eager decode and the captured graphs: each kernel waits for the one before it first,
    # so only the launches overlap and the answers are the same
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with pdl.programmatic_dependent_launch(True):
        if not pdl.launch_options(torch.empty(0, device="cuda")):
            pytest.skip("this GPU takes no programmatic dependent launch (before Hopper)")
        runner = check_graph_runner_equals_eager(engine_checkpoint, torch.device("cuda"), capture=True)
    assert set(runner.graphs) == {2, 8}


EAGER_AFTER_FAILED_CAPTURE = """
import sys
from tests.engine.conftest import mixed_conversations
from vlm_catalog import LLM, SamplingParams

settings = {"device": "cuda", "dtype": "float32", "max_num_batched_tokens": 96, "kv_cache_memory_bytes": 64 * 2**20}
failed_capture = LLM(sys.argv[1], **settings)
assert failed_capture.engine.runner.graph_runner is None, "the capture did not fail"
prompts, params = mixed_conversations(4), SamplingParams(max_tokens=8, ignore_eos=True)
eager = LLM(sys.argv[1], enforce_eager=True, **settings)
assert [o.token_ids for o in failed_capture.chat(prompts, params)] == [o.token_ids for o in eager.chat(prompts, params)]
print("same answers")
"""


@pytest.mark.gpu
def test_engine_decodes_eagerly_when_a_kernel_turned_off_cannot_be_captured(engine_checkpoint):
    """fused_moe named in VLM_CATALOG_KERNELS_OFF: its torch reference syncs with the host, which
    a CUDA-graph capture refuses; the engine starts anyway, without graphs, and answers as the
    engine that never captured (enforce_eager). In a process of its own, so that a capture
    failure that did poison the CUDA context fails this test alone."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    env = {**os.environ, "VLM_CATALOG_KERNELS_OFF": "fused_moe"}
    result = subprocess.run([sys.executable, "-c", EAGER_AFTER_FAILED_CAPTURE, str(engine_checkpoint)],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0 and "same answers" in result.stdout, result.stdout + result.stderr
