"""The attention output's row pieces to o_proj (vlm_catalog/model/text.py, `project_rows`).

A paged step's decode rows and prefill rows come from two kernels. A W8A8 o_proj on cuBLAS
quantizes each piece into its rows of the GEMM's FP8 input (kernels.fp8_linear_rows), where a
stacked 16-bit copy used to be made first; anything else takes the stack. Checked on CPU with
the documented stand-in for `F.scaled_mm` (tests/kernels/test_fp8_linear_cublas.py): the same
bits as the stacked input, and the pieces reach the GEMM as they are.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn

from kernels import fp8_linear_cublas as cublas
from kernels.fp8 import per_channel_block
from tests.kernels.test_fp8_linear_cublas import documented_scaled_mm
from vlm_catalog.model.attention import ContiguousKVCache
from vlm_catalog.model.fp8 import Fp8BlockQuantization
from vlm_catalog.model.text import Fp8Linear, project, project_rows


def per_channel_o_proj(in_features: int = 256, out_features: int = 128) -> Fp8Linear:
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16)
    block_n, block_k = per_channel_block(in_features)
    return Fp8Linear.quantized(linear, Fp8BlockQuantization(block_n=block_n, block_k=block_k))


def test_a_w8a8_o_proj_on_cublas_takes_the_pieces_as_they_are(monkeypatch):
    dense = importlib.import_module("kernels.fp8_linear")
    monkeypatch.setattr(cublas, "device_supported", lambda device: True)  # a CPU passing for a Hopper GPU
    monkeypatch.setattr(F, "scaled_mm", documented_scaled_mm)
    monkeypatch.setattr(cublas, "_checked", {})
    monkeypatch.setattr(dense, "use_triton", lambda *tensors, op: True)
    o_proj = per_channel_o_proj()
    rows = torch.randn(11, 256).to(torch.bfloat16)
    pieces = [rows[:3], rows[3:]]  # a step's 3 decode rows, then its prefill rows
    seen = []
    real = cublas.cublas_operands
    monkeypatch.setattr(cublas, "cublas_operands", lambda x, *args: seen.append(x) or real(x, *args))
    stacked = project(o_proj, rows)
    assert torch.equal(project_rows(o_proj, pieces), stacked)
    assert isinstance(seen[0], list) and len(seen[0]) == 1  # the stacked input: one piece
    assert len(seen[-1]) == 2 and all(got is want for got, want in zip(seen[-1], pieces))


def test_other_projections_and_paths_take_the_stack():
    linear = nn.Linear(256, 128)
    rows = torch.randn(9, 256)
    assert torch.equal(project_rows(linear, [rows[:4], rows[4:]]), project(linear, rows))
    o_proj = per_channel_o_proj()  # on CPU: the reference path, on the stacked rows
    rows = rows.to(torch.bfloat16)
    assert torch.equal(project_rows(o_proj, [rows[:4], rows[4:]]), project(o_proj, rows))
    assert torch.equal(project_rows(o_proj, [rows]), project(o_proj, rows))


def test_a_backend_s_row_pieces_stack_to_its_answer():
    cache = ContiguousKVCache(num_layers=1)
    cache.plan(["a"], [5])
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    pieces = cache.attend_rows(0, q, k, v, 8**-0.5)
    cache.free("a")
    cache.plan(["a"], [5])
    assert len(pieces) == 1 and torch.equal(pieces[0], cache.attend(0, q, k, v, 8**-0.5))


def test_a_mixed_paged_step_returns_its_decode_rows_then_its_prefill_rows():
    """PagedAttention on the CPU references: a step of 2 decode rows (contexts of 5 and 9 cached
    tokens) and a 3-token prefill chunk gives two pieces, [2, Hq, D] then [3, Hq, D], that stack
    to `attend`'s answer on the same caches."""
    from vlm_catalog.engine.paged_attention import (
        DecodeBatch,
        PagedAttention,
        PagedAttentionMetadata,
        PrefillBatch,
    )

    torch.manual_seed(1)
    blocks, block, heads, kv_heads, dim = 8, 4, 4, 2, 8
    caches = [(torch.randn(blocks, block, kv_heads, dim), torch.randn(blocks, block, kv_heads, dim))]
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 0]], dtype=torch.int32)
    decode = DecodeBatch(slot_mapping=torch.tensor([5, 3 * block + 9]), block_tables=tables[:2],
                         context_lens=torch.tensor([6, 10], dtype=torch.int32), max_context_len=10)
    prefill = PrefillBatch(slot_mapping=torch.tensor([6 * block + 0, 6 * block + 1, 6 * block + 2]),
                           block_tables=tables[2:], cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32),
                           context_lens=torch.tensor([3], dtype=torch.int32), max_query_len=3,
                           host_lens=([3], [3]))
    metadata = PagedAttentionMetadata(decode=decode, prefill=prefill)
    q, k, v = torch.randn(5, heads, dim), torch.randn(5, kv_heads, dim), torch.randn(5, kv_heads, dim)
    pieces = PagedAttention([tuple(t.clone() for t in caches[0])], metadata).attend_rows(0, q, k, v, dim**-0.5)
    assert [tuple(piece.shape) for piece in pieces] == [(2, heads, dim), (3, heads, dim)]
    whole = PagedAttention([tuple(t.clone() for t in caches[0])], metadata).attend(0, q, k, v, dim**-0.5)
    assert torch.equal(torch.cat(pieces), whole)
