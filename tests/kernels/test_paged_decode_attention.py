"""paged_decode_attention (+ the fused cache-write variant): reference vs float64 dense
attention on the K/V the cache was built from; Triton vs reference."""

from __future__ import annotations

import importlib

import pytest
import torch

import kernels
from kernels.arrival_counters import arrival_counters
from kernels.paged_decode_attention import (
    paged_decode_attention_reference,
    paged_decode_attention_triton,
    paged_decode_attention_with_kv_write_reference,
    paged_decode_attention_with_kv_write_triton,
)
from kernels.paged_decode_configs import (
    DECODE_CONFIGS,
    DecodeKernelConfig,
    decode_batch_bucket,
    default_decode_config,
    format_decode_config_entry,
    get_decode_config,
)
from tests.kernels.helpers import TOLERANCE, assert_close
from tests.kernels.paged import build_paged_kv, dense_attention_float64


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_reference_against_float64_dense(num_q_heads, num_kv_heads):
    # tolerance: 1e-5 relative (float32 scores and softmax)
    head_dim, scale = 16, 16**-0.5
    paged = build_paged_kv(
        [1, 9, 23, 0], 4, num_kv_heads, head_dim, torch.float32, torch.device("cpu")
    )
    q = torch.randn(4, num_q_heads, head_dim)
    out = paged_decode_attention_reference(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, scale
    )
    for seq, length in enumerate(paged.context_lens.tolist()):
        if length == 0:
            assert torch.equal(out[seq], torch.zeros_like(out[seq])), (
                "padding sequence must give zeros"
            )
            continue
        expected = dense_attention_float64(
            q[seq : seq + 1], paged.dense_k[seq], paged.dense_v[seq], scale
        )
        assert_close(out[seq : seq + 1], expected, rel=1e-5, what=f"sequence {seq}")


def test_cpu_dispatch_uses_reference():
    paged = build_paged_kv([5, 3], 2, 2, 8, torch.float32, torch.device("cpu"))
    q = torch.randn(2, 4, 8)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 0.3)
    torch.testing.assert_close(
        kernels.paged_decode_attention(*args),
        paged_decode_attention_reference(*args),
        rtol=0,
        atol=0,
    )


CASES = [
    # (context lengths, block size, Hq, Hkv, head_dim, num_splits)
    ([1, 17, 40, 0], 4, 4, 4, 32, None),  # GQA ratio 1, a padding sequence
    ([33, 5, 64], 16, 8, 2, 32, 1),  # GQA ratio 4, one split: the split kernel writes out, no reduce
    ([0, 9, 0], 4, 8, 2, 32, 1),  # one split with padding sequences: their rows are zeros
    ([130, 7], 4, 8, 2, 32, 3),  # contexts spanning several splits and many blocks
    ([21], 1, 8, 2, 16, 2),  # block size 1
    ([50, 3], 5, 6, 3, 24, None),  # odd block size and head dim, GQA ratio 2
    ([70], 16, 32, 4, 128, 2),  # model head dim and GQA ratio 8
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "context_lens,block_size,num_q_heads,num_kv_heads,head_dim,num_splits", CASES
)
def test_triton_paged_decode(
    triton_device,
    poison_allocations,
    dtype,
    context_lens,
    block_size,
    num_q_heads,
    num_kv_heads,
    head_dim,
    num_splits,
):
    # tolerance: TOLERANCE[dtype] (float32 1e-4, 16-bit 1e-2), max-norm relative
    paged = build_paged_kv(context_lens, block_size, num_kv_heads, head_dim, dtype, triton_device)
    q = torch.randn(len(context_lens), num_q_heads, head_dim).to(dtype).to(triton_device)
    scale = head_dim**-0.5
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, scale)
    out = paged_decode_attention_triton(*args, num_splits=num_splits)
    assert_close(out, paged_decode_attention_reference(*args), rel=TOLERANCE[dtype])


@pytest.mark.parametrize("config", [
    DecodeKernelConfig(block_n=16, num_warps=2, num_stages=1, programs_per_sm=8, min_split_tokens=16),
    DecodeKernelConfig(block_n=32, num_warps=8, num_stages=4, programs_per_sm=1, min_split_tokens=128),
    DecodeKernelConfig(block_n=128, num_warps=4, num_stages=3, programs_per_sm=4, min_split_tokens=128),
])
def test_triton_paged_decode_with_other_launch_settings(triton_device, config):
    """Any launch setting `--tune-decode` may pick computes the same attention (the split heuristic
    included: no `num_splits` override)."""
    # tolerance: TOLERANCE[float32]
    paged = build_paged_kv([300, 20, 0, 77], 8, 2, 16, torch.float32, triton_device)
    q = torch.randn(4, 4, 16, device=triton_device)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 0.25)
    out = paged_decode_attention_triton(*args, max_context_len=1024, config=config)
    assert_close(out, paged_decode_attention_reference(*args), rel=TOLERANCE[torch.float32])


def test_launch_settings_come_from_the_table_by_kv_dtype_head_dim_and_batch_bucket(monkeypatch):
    assert [decode_batch_bucket(b) for b in (1, 2, 8, 9, 256, 1000)] == [1, 8, 8, 32, 256, 256]
    assert get_decode_config(torch.bfloat16, 128, 5) == default_decode_config(128)  # no entries
    assert default_decode_config(128).block_n == 64 and default_decode_config(256).block_n == 32
    tuned = DecodeKernelConfig(block_n=128, num_stages=3, tuned=True)
    monkeypatch.setitem(DECODE_CONFIGS, ("float8_e4m3fn", 128, 32), tuned)
    assert get_decode_config(torch.float8_e4m3fn, 128, 20) is tuned
    assert get_decode_config(torch.bfloat16, 128, 20) == default_decode_config(128)  # another dtype
    line = format_decode_config_entry(torch.float8_e4m3fn, 128, 32, tuned)
    assert eval("{" + line.strip() + "}", {"DecodeKernelConfig": DecodeKernelConfig}) == {
        ("float8_e4m3fn", 128, 32): tuned}


def test_triton_split_heuristic_with_context_hint(triton_device):
    """Default split choice (no override), with and without the host-side max length."""
    paged = build_paged_kv([300, 20], 8, 2, 16, torch.float32, triton_device)
    q = torch.randn(2, 4, 16, device=triton_device)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 0.25)
    expected = paged_decode_attention_reference(*args)
    assert_close(kernels.paged_decode_attention(*args), expected, rel=1e-4)
    assert_close(kernels.paged_decode_attention(*args, max_context_len=300), expected, rel=1e-4)


@pytest.mark.parametrize("fused_write", [False, True])
def test_triton_splits_follow_each_sequences_length_under_a_far_larger_bound(triton_device, fused_write):
    """As in a CUDA graph captured for max_model_len: the grid's 8 splits are shared over each
    sequence's own length (700 tokens: 6 of 128, 130: 3 of 64, 5: one), not over the bound."""
    # tolerance: TOLERANCE[float32]
    context_lens, block_size, num_kv_heads, head_dim = [700, 5, 130, 0], 4, 2, 32
    paged = build_paged_kv(context_lens, block_size, num_kv_heads, head_dim, torch.float32, triton_device)
    q = torch.randn(len(context_lens), 8, head_dim, device=triton_device)
    args = (paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 0.2)
    if not fused_write:
        out = paged_decode_attention_triton(q, *args, max_context_len=8192, num_splits=8)
        assert_close(out, paged_decode_attention_reference(q, *args), rel=TOLERANCE[torch.float32])
        return
    k, v = torch.randn(2, len(context_lens), num_kv_heads, head_dim, device=triton_device)
    slots = [int(paged.block_tables[seq, (n - 1) // block_size]) * block_size + (n - 1) % block_size if n else -1
             for seq, n in enumerate(context_lens)]
    slot_mapping = torch.tensor(slots, device=triton_device)
    k_cache, v_cache = paged.k_cache.clone(), paged.v_cache.clone()
    out = paged_decode_attention_with_kv_write_triton(q, k, v, k_cache, v_cache, slot_mapping, *args[2:],
                                                      max_context_len=8192, num_splits=8)
    expected = paged_decode_attention_with_kv_write_reference(q, k, v, *args[:2], slot_mapping, *args[2:])
    assert_close(out, expected, rel=TOLERANCE[torch.float32])
    torch.testing.assert_close(k_cache, paged.k_cache, rtol=0, atol=0, equal_nan=True)  # as the reference wrote


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_fused_cache_write(triton_device, poison_allocations, dtype, num_splits):
    """The fused variant writes the current token's K/V (skipping padding) and attends to it."""
    # tolerance: TOLERANCE[dtype] for the output; the cache write is exact
    block_size, num_q_heads, num_kv_heads, head_dim = 4, 8, 2, 32
    context_lens = [9, 0, 30, 1]
    paged = build_paged_kv(context_lens, block_size, num_kv_heads, head_dim, dtype, triton_device)
    slots = []
    for seq, length in enumerate(context_lens):
        if length == 0:
            slots.append(-1)
            continue
        last = length - 1
        slots.append(
            int(paged.block_tables[seq, last // block_size]) * block_size + last % block_size
        )
    slot_mapping = torch.tensor(slots, device=triton_device)
    batch = len(context_lens)
    q = torch.randn(batch, num_q_heads, head_dim).to(dtype).to(triton_device)
    k = torch.randn(batch, num_kv_heads, head_dim).to(dtype).to(triton_device)
    v = torch.randn(batch, num_kv_heads, head_dim).to(dtype).to(triton_device)
    k_cache, v_cache = paged.k_cache.clone(), paged.v_cache.clone()
    expected_k_cache, expected_v_cache = paged.k_cache.clone(), paged.v_cache.clone()

    out = paged_decode_attention_with_kv_write_triton(
        q,
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        paged.block_tables,
        paged.context_lens,
        0.2,
        num_splits=num_splits,
    )
    expected = paged_decode_attention_with_kv_write_reference(
        q,
        k,
        v,
        expected_k_cache,
        expected_v_cache,
        slot_mapping,
        paged.block_tables,
        paged.context_lens,
        0.2,
    )
    torch.testing.assert_close(k_cache, expected_k_cache, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expected_v_cache, rtol=0, atol=0, equal_nan=True)
    assert_close(out, expected, rel=TOLERANCE[dtype])


def test_triton_rejects_bad_arguments(triton_device):
    paged = build_paged_kv([5, 3], 4, 2, 16, torch.float32, triton_device)
    q = torch.randn(2, 4, 16, device=triton_device)
    base = {
        "k_cache": paged.k_cache,
        "v_cache": paged.v_cache,
        "block_tables": paged.block_tables,
        "context_lens": paged.context_lens,
        "scale": 0.3,
    }
    with pytest.raises(ValueError, match="query heads"):
        paged_decode_attention_triton(torch.randn(2, 3, 16, device=triton_device), **base)
    with pytest.raises(ValueError, match="q"):
        paged_decode_attention_triton(q.to(torch.bfloat16), **base)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_attention_triton(q, **{**base, "context_lens": paged.context_lens[:1]})
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention_triton(q, **{**base, "block_tables": paged.block_tables.float()})


@pytest.mark.gpu
@pytest.mark.parametrize("context_len", [600, 27000])
def test_gpu_paged_decode_model_shapes(cuda_device, context_len):
    # tolerance: 1e-2 (bfloat16); Hq 32, Hkv 4, D 128, block size 16
    batch = 8
    lengths = [context_len - 37 * i for i in range(batch)]
    paged = build_paged_kv(lengths, 16, 4, 128, torch.bfloat16, cuda_device)
    q = torch.randn(batch, 32, 128, device=cuda_device, dtype=torch.bfloat16)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 128**-0.5)
    assert_close(
        kernels.paged_decode_attention(*args), paged_decode_attention_reference(*args), rel=1e-2
    )


def test_reference_with_a_prefix_shared_by_every_sequence():
    """Sequences whose tables start with the same blocks (a prefix-cached system prompt):
    the reference gathers those once; results equal dense float64 attention (1e-5 relative)."""
    import math

    from kernels.paged_decode_attention import paged_decode_attention_reference

    generator = torch.Generator().manual_seed(7)
    block_size, kv_heads, q_heads, head_dim = 4, 2, 4, 8
    k_cache = torch.randn(40, block_size, kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(40, block_size, kv_heads, head_dim, generator=generator)
    shared = [5, 9, 2]  # three full blocks every sequence starts with
    own = [[11, 12, 13], [20], [], [30, 31]]
    lengths = [12 + 10, 12 + 3, 12, 12 + 8]  # the third ends exactly where the shared part does
    width = 3 + max(len(o) for o in own)
    tables = torch.full((4, width), 39, dtype=torch.int32)  # filler past each table is never read
    for row, blocks in enumerate(own):
        tables[row, : 3 + len(blocks)] = torch.tensor(shared + blocks, dtype=torch.int32)
    q = torch.randn(4, q_heads, head_dim, generator=generator)
    scale = 1 / math.sqrt(head_dim)
    got = paged_decode_attention_reference(q, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32), scale)
    for row, length in enumerate(lengths):
        expected = dense_decode_float64(q[row], k_cache, v_cache, tables[row], length, scale)  # [Hq, D]
        assert torch.allclose(got[row].double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gather_bytes", [8 * 2**20, 1])  # 1 byte: every sequence is its own group
def test_reference_with_clusters_loners_empty_rows_and_poisoned_slots(monkeypatch, gather_bytes):
    """A batch as the engine builds it: two sequence clusters sharing leading blocks, sequences
    sharing nothing, a padding row, and NaN in every cache slot no sequence may read.
    Equal to dense float64 attention (1e-5 relative); the padding row is zeros."""
    import importlib

    decode_module = importlib.import_module("kernels.paged_decode_attention")
    monkeypatch.setattr(decode_module, "GATHER_BYTES_PER_GROUP", gather_bytes)
    generator = torch.Generator().manual_seed(11)
    block_size, kv_heads, q_heads, head_dim, num_blocks = 4, 2, 8, 8, 48
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    v_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    tables_and_lengths = [
        ([1, 2, 3, 10], 15), ([1, 2, 3, 11, 12], 17), ([1, 2, 3], 12),  # cluster: 3 shared blocks
        ([20, 21, 22], 9), ([20, 21, 23], 11),  # cluster: 2 shared blocks (MIN_SHARED_BLOCKS)
        ([30, 31], 6), ([40], 1),  # alone
        ([47], 0),  # padding row
    ]
    for table, length in tables_and_lengths:
        for position in range(length):  # only the slots some sequence reads get numbers
            block, slot = table[position // block_size], position % block_size
            k_cache[block, slot] = torch.randn(kv_heads, head_dim, generator=generator)
            v_cache[block, slot] = torch.randn(kv_heads, head_dim, generator=generator)
    width = max(len(table) for table, _ in tables_and_lengths)
    tables = torch.full((len(tables_and_lengths), width), 46, dtype=torch.int32)  # block 46: all NaN
    for row, (table, _) in enumerate(tables_and_lengths):
        tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    lengths = torch.tensor([length for _, length in tables_and_lengths], dtype=torch.int32)
    q = torch.randn(len(tables_and_lengths), q_heads, head_dim, generator=generator)
    scale = head_dim**-0.5
    got = decode_module.paged_decode_attention_reference(q, k_cache, v_cache, tables, lengths, scale)
    for row, (_, length) in enumerate(tables_and_lengths):
        if length == 0:
            assert torch.equal(got[row], torch.zeros_like(got[row]))
            continue
        expected = dense_decode_float64(q[row], k_cache, v_cache, tables[row], length, scale)  # [Hq, D]
        assert_close(got[row], expected, rel=1e-5, what=f"row {row}")


def dense_decode_float64(q_row, k_cache, v_cache, table, length, scale):
    """One sequence's decode attention in float64, reading its `length` cached tokens through `table`."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    positions = torch.arange(length)
    blocks = table[positions // block_size].long()
    keys = k_cache[blocks, positions % block_size].double()  # [L, Hkv, D]
    values = v_cache[blocks, positions % block_size].double()
    group = q_row.shape[0] // kv_heads
    out = []
    for head in range(q_row.shape[0]):
        weights = torch.softmax(keys[:, head // group] @ q_row[head].double() * scale, dim=0)  # [L]
        out.append(weights @ values[:, head // group])
    return torch.stack(out)  # [Hq, D]


@pytest.mark.parametrize("merge_tile", [None, 256], ids=["one merge step", "two splits per merge step"])
@pytest.mark.parametrize("merge_in_place", [True, False], ids=["merged in place", "reduce launch"])
def test_the_last_split_to_finish_merges_the_splits_in_place(triton_device, poison_allocations, monkeypatch,
                                                             merge_in_place, merge_tile):
    """Several splits: each (sequence, KV head)'s last split to finish merges them, and no reduce
    kernel launches; a sequence one split holds writes its output directly; the counters are back
    at zero after the launch. `decode_merge_in_place` off: the reduce kernel's launch, the same
    output."""
    # tolerance: TOLERANCE[float32] against the reference, for both ways
    jit = pytest.importorskip("kernels.jit.paged_decode_attention")
    module = importlib.import_module("kernels.paged_decode_attention")
    if merge_tile is not None:  # [G=4, splits, D=32] float32 per step: 2 splits, so the merge loops
        monkeypatch.setattr(module, "MERGE_TILE", merge_tile)
    if not merge_in_place:
        monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "decode_merge_in_place")
    reduce_launches = []
    real_reduce = jit.paged_decode_reduce_kernel
    monkeypatch.setattr(jit, "paged_decode_reduce_kernel", ReduceSpy(real_reduce, reduce_launches))
    context_lens, block_size, num_kv_heads, head_dim = [700, 5, 130, 0, 64], 4, 2, 32
    paged = build_paged_kv(context_lens, block_size, num_kv_heads, head_dim, torch.float32, triton_device)
    q = torch.randn(len(context_lens), 8, head_dim, device=triton_device)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 0.2)
    for _ in range(2):  # the second launch finds the counters as the first left them
        out = paged_decode_attention_triton(*args, max_context_len=8192, num_splits=8)
        assert_close(out, paged_decode_attention_reference(*args), rel=TOLERANCE[torch.float32])
    assert len(reduce_launches) == (0 if merge_in_place else 2)
    assert int(arrival_counters(triton_device, 1).abs().sum()) == 0


def test_more_pairs_than_arrival_counters_take_the_reduce_launch(triton_device, monkeypatch):
    jit = pytest.importorskip("kernels.jit.paged_decode_attention")
    counters_module = importlib.import_module("kernels.arrival_counters")
    monkeypatch.setattr(counters_module, "ARRIVAL_COUNTERS", 3)  # 2 sequences x 2 KV heads need 4
    monkeypatch.setattr(counters_module, "_counters", {})  # this test's 3 counters stay in this test
    assert arrival_counters(triton_device, 4) is None and arrival_counters(triton_device, 3) is not None
    reduce_launches = []
    monkeypatch.setattr(jit, "paged_decode_reduce_kernel", ReduceSpy(jit.paged_decode_reduce_kernel, reduce_launches))
    paged = build_paged_kv([300, 40], 8, 2, 16, torch.float32, triton_device)
    q = torch.randn(2, 4, 16, device=triton_device)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 0.25)
    out = paged_decode_attention_triton(*args, max_context_len=1024, num_splits=4)
    assert_close(out, paged_decode_attention_reference(*args), rel=TOLERANCE[torch.float32])
    assert len(reduce_launches) == 1


@pytest.mark.gpu
@pytest.mark.fast_path("decode_merge_in_place")
def test_gpu_the_in_place_merge_is_race_free_and_deterministic(cuda_device, monkeypatch):
    """Many splits finishing in any order on the GPU (the interpreter runs them one by one):
    every launch gives the same bits (the merge's order is the splits', whoever merges), those
    of a capture replayed too, close to the reduce launch's, and the counters end at zero."""
    # tolerance: 1e-2 (bfloat16) against the reference; bitwise across launches and replays
    batch = 32
    lengths = [300 + 517 * i for i in range(batch)]  # 300 to 16k tokens: 2 to 64 splits used
    paged = build_paged_kv(lengths, 16, 4, 128, torch.bfloat16, cuda_device)
    q = torch.randn(batch, 32, 128, device=cuda_device, dtype=torch.bfloat16)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 128**-0.5)
    first = paged_decode_attention_triton(*args, max_context_len=32768, num_splits=64)
    assert_close(first, paged_decode_attention_reference(*args), rel=1e-2)
    for _ in range(50):
        assert torch.equal(paged_decode_attention_triton(*args, max_context_len=32768, num_splits=64), first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = paged_decode_attention_triton(*args, max_context_len=32768, num_splits=64)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, first)
    assert int(arrival_counters(cuda_device, 1).abs().sum()) == 0
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "decode_merge_in_place")
    assert_close(first, paged_decode_attention_triton(*args, max_context_len=32768, num_splits=64), rel=1e-2)


class ReduceSpy:
    """Stands in for the reduce kernel: counts its launches and launches it."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


AHEAD_CONFIG = DecodeKernelConfig(block_n=16, num_warps=4, num_stages=3, programs_per_sm=2, min_split_tokens=16)


def test_block_ids_are_loaded_ahead_on_three_stages_or_more(monkeypatch):
    module = importlib.import_module("kernels.paged_decode_attention")
    assert module.loads_block_ids_ahead(AHEAD_CONFIG)
    assert module.loads_block_ids_ahead(DecodeKernelConfig(block_n=64, num_stages=4))
    assert not module.loads_block_ids_ahead(DecodeKernelConfig(block_n=64, num_stages=2))  # as tuned before
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "decode_ids_ahead")
    assert not module.loads_block_ids_ahead(AHEAD_CONFIG)


def _decode_with_kv_write(paged, block_size, num_splits, device, seed=0):
    """(output, K cache, V cache) of a fused-write decode step on copies of `paged`'s caches, over
    its sequences (the current token at each one's last position), on AHEAD_CONFIG."""
    generator = torch.Generator().manual_seed(seed)
    batch, num_kv_heads, head_dim = len(paged.context_lens), paged.k_cache.shape[2], paged.k_cache.shape[3]
    q = torch.randn(batch, 4 * num_kv_heads, head_dim, generator=generator).to(torch.bfloat16).to(device)
    k = torch.randn(batch, num_kv_heads, head_dim, generator=generator).to(torch.bfloat16).to(device)
    v = torch.randn(batch, num_kv_heads, head_dim, generator=generator).to(torch.bfloat16).to(device)
    slots = [-1 if length == 0 else int(paged.block_tables[seq, (length - 1) // block_size]) * block_size
             + (length - 1) % block_size for seq, length in enumerate(paged.context_lens.tolist())]
    k_cache, v_cache = paged.k_cache.clone(), paged.v_cache.clone()
    out = paged_decode_attention_with_kv_write_triton(
        q, k, v, k_cache, v_cache, torch.tensor(slots, device=device), paged.block_tables, paged.context_lens,
        head_dim**-0.5, max_context_len=1024, num_splits=num_splits, config=AHEAD_CONFIG)
    return out, k_cache, v_cache


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_block_ids_loaded_ahead_give_the_bits_of_the_same_iteration(triton_device, poison_allocations, monkeypatch,
                                                                   cache_dtype, num_splits):
    """The split kernel with each tile's block ids loaded an iteration before its K/V (3 stages)
    gives the output and writes the cache bit for bit as the loop loading them in the same
    iteration (`decode_ids_ahead` off): sequences of 0, 1 and 2 tokens, ones ending inside a block
    and on a block's last slot, splits ending mid-tile, one split or several (merged in place)."""
    # tolerance: exact against the loop it replaces; TOLERANCE[bfloat16] against the reference
    block_size = 4
    paged = build_paged_kv([0, 1, 2, 37, 16, 130], block_size, 2, 32, cache_dtype, triton_device)
    ahead = _decode_with_kv_write(paged, block_size, num_splits, triton_device)
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "decode_ids_ahead")
    same_iteration = _decode_with_kv_write(paged, block_size, num_splits, triton_device)
    for mine, theirs in zip(ahead, same_iteration, strict=True):
        assert torch.equal(mine.cpu().view(torch.uint8), theirs.cpu().view(torch.uint8))
    monkeypatch.delenv("VLM_CATALOG_KERNELS_OFF")
    q = torch.randn(6, 8, 32).to(torch.bfloat16).to(triton_device)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 32**-0.5)
    reference = paged_decode_attention_reference(q, paged.k_cache.to(torch.bfloat16),
                                                 paged.v_cache.to(torch.bfloat16), *args[3:])
    out = paged_decode_attention_triton(*args, max_context_len=1024, num_splits=num_splits, config=AHEAD_CONFIG)
    assert_close(out, reference, rel=TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.fast_path("decode_ids_ahead")
def test_gpu_block_ids_loaded_ahead_give_the_bits_of_the_same_iteration(cuda_device, monkeypatch):
    """On the GPU at the engine's shapes (FP8 cache, bf16 query, 32 query and 4 KV heads of 128,
    block size 16) on the H100 table's batch-256 settings (128 positions a tile, 3 stages): the
    loop loading the block ids ahead gives the bits of the one loading them in the same
    iteration, the in-place merge included."""
    # tolerance: exact between the two loops; 1e-2 (bfloat16) against the reference
    config = DecodeKernelConfig(block_n=128, num_warps=4, num_stages=3, programs_per_sm=8, min_split_tokens=256)
    lengths = [37 + 131 * i for i in range(64)]  # 37 to 8k tokens
    paged = build_paged_kv(lengths, 16, 4, 128, torch.float8_e4m3fn, cuda_device)
    q = torch.randn(len(lengths), 32, 128, device=cuda_device, dtype=torch.bfloat16)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 128**-0.5)
    ahead = paged_decode_attention_triton(*args, max_context_len=32768, config=config)
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "decode_ids_ahead")
    assert torch.equal(paged_decode_attention_triton(*args, max_context_len=32768, config=config), ahead)
    widened = (paged.k_cache.to(torch.bfloat16), paged.v_cache.to(torch.bfloat16))
    assert_close(ahead, paged_decode_attention_reference(q, *widened, *args[3:]), rel=1e-2)


def test_a_sequences_heads_launch_together_unless_turned_off_or_past_the_grid_limit(monkeypatch):
    module = importlib.import_module("kernels.paged_decode_attention")
    assert module.launches_heads_together(256) and module.launches_heads_together(module.MAX_GRID_Y)
    assert not module.launches_heads_together(module.MAX_GRID_Y + 1)  # CUDA's grid y limit: sequences there
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "decode_heads_together")
    assert not module.launches_heads_together(256)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_heads_launched_together_give_the_bits_of_heads_apart(triton_device, poison_allocations, monkeypatch,
                                                             cache_dtype):
    """The split kernel's grid (KV head, sequence, split) gives the output and writes the cache bit
    for bit as (sequence, KV head, split) (`decode_heads_together` off), the in-place merge's
    counters (one per sequence and KV head) included: 3 splits, 2 KV heads, lengths 0 to 130."""
    # tolerance: exact against the other grid
    module = importlib.import_module("kernels.paged_decode_attention")
    launched = []
    real_launch = module._launch_decode

    def spy(*args, **kwargs):
        launched.append(module.launches_heads_together(args[0].shape[0]))
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(module, "_launch_decode", spy)
    paged = build_paged_kv([0, 1, 2, 37, 16, 130], 4, 2, 32, cache_dtype, triton_device)
    together = _decode_with_kv_write(paged, 4, 3, triton_device)
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "decode_heads_together")
    apart = _decode_with_kv_write(paged, 4, 3, triton_device)
    assert launched == [True, False]
    for mine, theirs in zip(together, apart, strict=True):
        assert torch.equal(mine.cpu().view(torch.uint8), theirs.cpu().view(torch.uint8))
    assert int(arrival_counters(triton_device, 1).abs().sum()) == 0  # both grids leave them at zero


@pytest.mark.gpu
@pytest.mark.fast_path("decode_heads_together")
def test_gpu_heads_launched_together_give_the_bits_of_heads_apart(cuda_device, monkeypatch):
    """On the GPU at the engine's shapes (FP8 cache, 32 query and 4 KV heads of 128, block size 16),
    with splits merged in place: the grid (KV head, sequence, split) gives the bits of (sequence,
    KV head, split)."""
    # tolerance: exact between the two grids
    lengths = [37 + 131 * i for i in range(64)]
    paged = build_paged_kv(lengths, 16, 4, 128, torch.float8_e4m3fn, cuda_device)
    q = torch.randn(len(lengths), 32, 128, device=cuda_device, dtype=torch.bfloat16)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 128**-0.5)
    together = paged_decode_attention_triton(*args, max_context_len=32768, num_splits=16)
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "decode_heads_together")
    assert torch.equal(paged_decode_attention_triton(*args, max_context_len=32768, num_splits=16), together)
