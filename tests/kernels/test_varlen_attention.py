"""varlen_attention: reference vs float64 per-segment attention, Triton vs reference,
and the CUDA backend choice."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch

import kernels
from kernels.flash_varlen import flash_varlen_attention, flash_varlen_function, flash_varlen_usable
from kernels.varlen_attention import (
    SDPA_MIN_SEGMENT_LEN,
    VARLEN_BACKEND_ENV_VAR,
    varlen_attention_on_device,
    varlen_attention_per_segment,
    varlen_attention_reference,
    varlen_attention_triton,
    varlen_backend,
)
from tests.kernels.flash_fakes import FakeFlashVarlen
from tests.kernels.helpers import TOLERANCE, assert_close
from tests.kernels.paged import dense_attention_float64


def packed(segment_lens: list[int], num_heads: int, head_dim: int, dtype, device):
    cu_seqlens = torch.tensor([0] + segment_lens).cumsum(0).to(torch.int32).to(device)
    total = int(cu_seqlens[-1])
    q, k, v = (torch.randn(total, num_heads, head_dim).to(dtype).to(device) for _ in range(3))
    return q, k, v, cu_seqlens


def test_reference_against_float64_per_segment():
    # tolerance: 1e-5 relative (float32); segments never see each other
    q, k, v, cu_seqlens = packed([4, 1, 9], 3, 16, torch.float32, "cpu")
    out = varlen_attention_reference(q, k, v, cu_seqlens, 0.25)
    bounds = cu_seqlens.tolist()
    for begin, end in itertools.pairwise(bounds):
        expected = dense_attention_float64(q[begin:end], k[begin:end], v[begin:end], 0.25)
        assert_close(out[begin:end], expected, rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "segment_lens,num_heads,head_dim",
    [
        ([5], 2, 16),
        ([3, 0, 70, 1], 2, 72),  # vision head dim 72, an empty segment, a 2-tile segment
        ([17, 40], 4, 32),
    ],
)
def test_triton_varlen_attention(
    triton_device, poison_allocations, dtype, segment_lens, num_heads, head_dim
):
    # tolerance: TOLERANCE[dtype] (float32 1e-4, 16-bit 1e-2), max-norm relative
    q, k, v, cu_seqlens = packed(segment_lens, num_heads, head_dim, dtype, triton_device)
    out = kernels.varlen_attention(q, k, v, cu_seqlens, head_dim**-0.5)
    assert_close(
        out, varlen_attention_reference(q, k, v, cu_seqlens, head_dim**-0.5), rel=TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [48, 72, 96])
def test_triton_padded_heads_whole_and_partial_key_tiles(triton_device, poison_allocations, dtype, head_dim):
    # tolerance: TOLERANCE[dtype]; heads padded to a power of two (72 -> 128), segments of whole
    # key tiles, a partial last tile, and a single row
    q, k, v, cu_seqlens = packed([130, 64, 1], 2, head_dim, dtype, triton_device)
    out = varlen_attention_triton(q, k, v, cu_seqlens, head_dim**-0.5, max_seqlen=130)
    assert_close(out, varlen_attention_reference(q, k, v, cu_seqlens, head_dim**-0.5), rel=TOLERANCE[dtype])


def test_triton_strided_views_of_a_fused_qkv(triton_device):
    num_tokens, num_heads, head_dim = 12, 2, 16
    qkv = torch.randn(num_tokens, 3, num_heads, head_dim, device=triton_device)
    q, k, v = qkv.unbind(1)  # strided [N, H, D] views, as the vision tower produces them
    cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32, device=triton_device)
    assert_close(
        varlen_attention_triton(q, k, v, cu_seqlens, 0.3, max_seqlen=7),
        varlen_attention_reference(q, k, v, cu_seqlens, 0.3),
        rel=1e-4,
    )


def test_triton_head_stride_a_multiple_of_8_not_16(triton_device):
    # the vision tower's layout: q, k, v views of one [N, 3, 16, 72] projection; the kernel
    # is told the strides are multiples of 8 and must still read the right rows
    qkv = torch.randn(40, 3, 3, 72, device=triton_device)
    q, k, v = qkv.unbind(1)  # [N, H, D] views with strides (648, 72, 1)
    cu_seqlens = torch.tensor([0, 9, 40], dtype=torch.int32, device=triton_device)
    assert_close(
        varlen_attention_triton(q, k, v, cu_seqlens, 72**-0.5, max_seqlen=31),
        varlen_attention_reference(q, k, v, cu_seqlens, 72**-0.5),
        rel=1e-4,
    )


def test_backend_choice(monkeypatch):
    monkeypatch.delenv(VARLEN_BACKEND_ENV_VAR, raising=False)
    assert varlen_backend(SDPA_MIN_SEGMENT_LEN) == "sdpa"
    assert varlen_backend(SDPA_MIN_SEGMENT_LEN - 1) == "triton"
    monkeypatch.setenv(VARLEN_BACKEND_ENV_VAR, "triton")
    assert varlen_backend(10**6) == "triton"
    monkeypatch.setenv(VARLEN_BACKEND_ENV_VAR, "flash")  # the varlen kernel; per segment as in auto
    assert varlen_backend(SDPA_MIN_SEGMENT_LEN) == "sdpa"
    monkeypatch.setenv(VARLEN_BACKEND_ENV_VAR, "cudnn")
    with pytest.raises(ValueError, match="not one of auto, flash, triton, sdpa"):
        varlen_backend(1)


def test_the_varlen_kernel_takes_every_segment_in_one_call(fake_flash):
    fake = fake_flash(FakeFlashVarlen())
    q, k, v, cu_seqlens = packed([5, 40, 0, 33], 2, 16, torch.bfloat16, "cpu")
    out = varlen_attention_on_device(q, k, v, cu_seqlens.long(), 16**-0.5, seqlens=[5, 40, 0, 33])
    assert torch.equal(out, varlen_attention_reference(q, k, v, cu_seqlens, 16**-0.5))
    (call,) = fake.calls
    assert call["max_q"] == call["max_k"] == 40 and call["scale"] is None  # the default scale is not passed
    assert call["window_size"] == (-1, -1) and not call["enable_gqa"]  # bidirectional, as many KV heads as q
    assert call["cu_seq_q"].dtype == torch.int32 and call["cu_seq_q"].tolist() == [0, 5, 45, 45, 78]
    varlen_attention_on_device(q, k, v, cu_seqlens, 0.3, max_seqlen=40)
    assert fake.calls[1]["scale"] == 0.3


def test_a_segment_long_enough_for_sdpa_takes_the_call_segment_by_segment(fake_flash, triton_device, monkeypatch):
    """The H100 measured per-segment SDPA 1.3-1.4x faster than the varlen kernel on images of
    4096 patches and more: with one such segment the call goes segment by segment, unless the
    environment forces the varlen kernel. Tolerance: 1e-2 (bfloat16, the per-segment path's own)."""
    monkeypatch.delenv(VARLEN_BACKEND_ENV_VAR, raising=False)
    monkeypatch.setattr(sys.modules["kernels.varlen_attention"], "SDPA_MIN_SEGMENT_LEN", 30)
    fake = fake_flash(FakeFlashVarlen())
    q, k, v, cu_seqlens = packed([5, 40, 9], 2, 16, torch.bfloat16, triton_device)
    out = varlen_attention_on_device(q, k, v, cu_seqlens, 0.25, seqlens=[5, 40, 9])
    assert fake.calls == []
    assert_close(out, varlen_attention_reference(q, k, v, cu_seqlens, 0.25), rel=1e-2)
    varlen_attention_on_device(q, k, v, cu_seqlens, 0.25, seqlens=[5, 29, 9])  # all shorter: one varlen call
    assert len(fake.calls) == 1
    monkeypatch.setenv(VARLEN_BACKEND_ENV_VAR, "flash")
    varlen_attention_on_device(q, k, v, cu_seqlens, 0.25, seqlens=[5, 40, 9])
    assert len(fake.calls) == 2


def test_the_varlen_kernel_is_not_asked_what_it_cannot_take(fake_flash, triton_device, monkeypatch):
    fake = fake_flash(FakeFlashVarlen())
    q, k, v, cu_seqlens = packed([5, 9], 2, 16, torch.float32, triton_device)  # float32: not FlashAttention's
    varlen_attention_on_device(q, k, v, cu_seqlens, 0.25, seqlens=[5, 9])
    q, k, v, cu_seqlens = packed([5, 9], 2, 12, torch.bfloat16, triton_device)  # head size not a multiple of 8
    varlen_attention_on_device(q, k, v, cu_seqlens, 0.25, seqlens=[5, 9])
    monkeypatch.setenv(VARLEN_BACKEND_ENV_VAR, "sdpa")
    q, k, v, cu_seqlens = packed([5, 9], 2, 16, torch.bfloat16, triton_device)
    varlen_attention_on_device(q, k, v, cu_seqlens, 0.25, seqlens=[5, 9])
    assert fake.calls == []


def test_a_varlen_kernel_that_fails_hands_over_to_the_segments_for_good(fake_flash, triton_device, caplog):
    # tolerance: 1e-2 (bfloat16), the per-segment path's own
    fake = fake_flash(FakeFlashVarlen(RuntimeError("FlashAttention only supports Ampere GPUs or newer")))
    q, k, v, cu_seqlens = packed([5, 9], 2, 16, torch.bfloat16, triton_device)
    for _ in range(2):
        out = varlen_attention_on_device(q, k, v, cu_seqlens, 0.25, seqlens=[5, 9])
        assert_close(out, varlen_attention_reference(q, k, v, cu_seqlens, 0.25), rel=1e-2)
    assert len(fake.calls) == 1  # not tried again
    assert "FlashAttention varlen (torch) failed for bidirectional attention (RuntimeError: FlashAttention only supports" \
        in caplog.text


@pytest.mark.parametrize("segment_lens", [[5, 40, 3, 0, 33, 7], [40, 33], [5, 3, 7]])
def test_per_segment_backends_write_every_row_once(triton_device, poison_allocations, monkeypatch, segment_lens):
    """Long segments through SDPA, short ones in one Triton launch that skips the long ones:
    together they equal the reference (poisoned allocations show unwritten rows)."""
    monkeypatch.delenv(VARLEN_BACKEND_ENV_VAR, raising=False)
    monkeypatch.setattr(sys.modules["kernels.varlen_attention"], "SDPA_MIN_SEGMENT_LEN", 30)
    q, k, v, cu_seqlens = packed(segment_lens, 2, 16, torch.float32, triton_device)
    assert_close(
        varlen_attention_per_segment(q, k, v, cu_seqlens, 0.25, segment_lens),
        varlen_attention_reference(q, k, v, cu_seqlens, 0.25),
        rel=1e-4,
    )


def test_triton_leaves_segments_over_max_segment_len_unwritten(triton_device):
    q, k, v, cu_seqlens = packed([6, 20, 4], 2, 16, torch.float32, triton_device)
    out = varlen_attention_triton(q, k, v, cu_seqlens, 0.25, max_seqlen=6, max_segment_len=6)
    expected = varlen_attention_reference(q, k, v, cu_seqlens, 0.25)
    computed = torch.cat([torch.arange(0, 6), torch.arange(26, 30)])
    assert_close(out[computed], expected[computed], rel=1e-4)


def test_triton_rejects_bad_arguments(triton_device):
    q, k, v, cu_seqlens = packed([3, 4], 2, 16, torch.float32, triton_device)
    with pytest.raises(ValueError, match="k"):
        varlen_attention_triton(q, k[:5], v, cu_seqlens, 0.3)
    with pytest.raises(ValueError, match="cu_seqlens"):
        varlen_attention_triton(q, k, v, cu_seqlens.float(), 0.3)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "sdpa", "flash", "auto"])
def test_gpu_varlen_attention_vision_shapes(cuda_device, monkeypatch, backend):
    # tolerance: 1e-2 (bfloat16); vision tower: 16 heads of 72, images of 1k-16k patches
    monkeypatch.setenv(VARLEN_BACKEND_ENV_VAR, backend)
    q, k, v, cu_seqlens = packed([1024, 4096, 15625], 16, 72, torch.bfloat16, cuda_device)
    assert_close(
        kernels.varlen_attention(q, k, v, cu_seqlens, 72**-0.5),
        varlen_attention_reference(q, k, v, cu_seqlens, 72**-0.5),
        rel=1e-2,
    )


@pytest.mark.gpu
def test_gpu_takes_the_flash_varlen_kernel(cuda_device):
    # tolerance: 1e-2 (bfloat16); fails loudly where this torch has no varlen kernel, so the GPU record says so
    assert flash_varlen_function() is not None, f"torch {torch.__version__} has no torch.nn.attention.varlen"
    q, k, v, cu_seqlens = packed([256] * 8 + [1024], 16, 72, torch.bfloat16, cuda_device)
    out = flash_varlen_attention(q, k, v, cu_seqlens, 72**-0.5, 1024)
    assert_close(out, varlen_attention_reference(q, k, v, cu_seqlens, 72**-0.5), rel=1e-2)
    assert flash_varlen_usable(q, "bidirectional")


def test_long_segments_ask_sdpa_for_cudnn_first_when_set(monkeypatch):
    """VLM_CATALOG_SDPA_BACKEND=cudnn: the per-segment SDPA calls run with cuDNN's attention
    first in torch's priority order (here on CPU, where cuDNN is absent, the next backend runs
    and the answer is the reference's); the reference keeps torch's own order."""
    from torch.nn import functional

    module = sys.modules["kernels.varlen_attention"]  # `kernels.varlen_attention` is also the function
    orders = []
    real_sdpa = functional.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        orders.append(torch._C._get_sdp_priority_order()[0])
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(module.F, "scaled_dot_product_attention", recording_sdpa)
    lengths = [SDPA_MIN_SEGMENT_LEN, SDPA_MIN_SEGMENT_LEN + 8]  # all long: no Triton launch
    q, k, v, cu_seqlens = packed(lengths, 2, 8, torch.float32, "cpu")
    reference = varlen_attention_reference(q, k, v, cu_seqlens, 0.3)
    default_first = orders[0]
    assert default_first != int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
    monkeypatch.setenv("VLM_CATALOG_SDPA_BACKEND", "cudnn")
    orders.clear()
    out = varlen_attention_per_segment(q, k, v, cu_seqlens, 0.3, lengths)
    assert orders == [int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)] * 2
    assert torch.equal(out, reference)
    assert torch._C._get_sdp_priority_order()[0] == default_first  # restored after the calls
    orders.clear()
    varlen_attention_reference(q, k, v, cu_seqlens, 0.3)
    assert orders == [default_first] * 2


def test_an_unknown_sdpa_backend_is_named(monkeypatch):
    monkeypatch.setenv("VLM_CATALOG_SDPA_BACKEND", "cudnn3")
    q, k, v, cu_seqlens = packed([SDPA_MIN_SEGMENT_LEN], 1, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="VLM_CATALOG_SDPA_BACKEND='cudnn3' is not one of default, cudnn"):
        varlen_attention_per_segment(q, k, v, cu_seqlens, 0.3, [SDPA_MIN_SEGMENT_LEN])


@pytest.mark.gpu
def test_gpu_cudnn_sdpa_matches_the_reference(cuda_device):
    # tolerance: 1e-2 (bfloat16), as the other vision-shape tests. cuDNN alone is allowed, so a
    # shape it refuses fails here ("No available kernel") instead of falling back unseen
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels.varlen_attention import _sdpa_segments

    lengths = [SDPA_MIN_SEGMENT_LEN, 4096, 15625]  # the vision tower's long images: 16 heads of 72
    q, k, v, cu_seqlens = packed(lengths, 16, 72, torch.bfloat16, cuda_device)
    bounds = list(itertools.pairwise(cu_seqlens.tolist()))
    out = torch.empty_like(q)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        _sdpa_segments(q, k, v, bounds, 72**-0.5, out, backend="default")
    assert_close(out, varlen_attention_reference(q, k, v, cu_seqlens, 72**-0.5), rel=1e-2)
