"""The W8A8 dense GEMM on cuBLAS (kernels/fp8_linear_cublas.py), with 128 x 128 blocks and
per-channel (row-wise) scales, checked on CPU three ways:

- the operands it builds pass torch's own shape and stride checks for block-scaled and
  row-wise `F.scaled_mm` (its meta function, run under FakeTensorMode);
- with a stand-in for `F.scaled_mm` that computes what torch documents (each
  operand times its block scales, one float32 GEMM), the result matches
  `fp8_linear_reference` at TOLERANCE[dtype], as the Triton kernel does;
- the first-call check accepts a correct GEMM once per shape and turns a wrong or
  failing one into the Triton kernel.
The GPU run (`tests/kernels/test_gpu.py`) checks the real cuBLAS GEMM against the reference.
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import kernels
from kernels import fp8_linear_cublas as cublas
from kernels.fp8 import per_channel_block, quantize
from kernels.fp8_input import Fp8InputLayout, quantize_fp8_input
from kernels.fp8_linear import fp8_linear_reference
from tests.kernels.helpers import TOLERANCE, assert_close

BLOCK = (128, 128)
SHAPES = [(1, 2048, 5120), (6, 1152, 1152), (256, 4096, 2048), (4, 256, 384)]  # (M, K, N); 1152: 9 K-blocks


def inputs(rows, in_features, out_features, dtype=torch.bfloat16, block=BLOCK):
    x = torch.randn(rows, in_features).to(dtype)
    weight, scale = quantize(torch.randn(out_features, in_features) / in_features**0.5, block)
    return x, weight, scale


def documented_scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=torch.bfloat16, **_):
    """What torch documents `F.scaled_mm` to compute: (a x scale_a) @ (b x scale_b). Block-scaled:
    scale_a [M, ceil(K/128)] per row and 128 columns, scale_b [>= ceil(K/128), ceil(N/128)] per
    128 x 128. Row-wise: scale_a [M, 1] per row of a, scale_b [1, N] per column of b."""
    if recipe_a == F.ScalingType.RowWise:
        assert recipe_b == F.ScalingType.RowWise and scale_a.shape == (a.shape[0], 1)
        assert scale_b.shape == (1, b.shape[1])
        return ((a.float() * scale_a) @ (b.float() * scale_b)).to(output_dtype)
    assert recipe_a == F.ScalingType.BlockWise1x128 and recipe_b == F.ScalingType.BlockWise128x128
    depth, columns = a.shape[1], b.shape[1]
    per_element_a = scale_a.repeat_interleave(128, dim=1)[:, :depth]  # [M, K]
    per_element_b = scale_b.repeat_interleave(128, dim=0)[:depth].repeat_interleave(128, dim=1)[:, :columns]  # [K, N]
    return ((a.float() * per_element_a) @ (b.float() * per_element_b)).to(output_dtype)


@pytest.fixture
def hopper(monkeypatch):
    """A CPU that passes for a Hopper GPU with a block-scaled `F.scaled_mm` (the documented one)."""
    monkeypatch.setattr(cublas, "device_supported", lambda device: True)
    monkeypatch.setattr(F, "scaled_mm", documented_scaled_mm)
    monkeypatch.setattr(cublas, "_checked", {})


@pytest.mark.parametrize("rows,in_features,out_features", SHAPES)
def test_operands_pass_torchs_own_checks_for_block_scaled_scaled_mm(rows, in_features, out_features):
    x, weight, scale = inputs(rows, in_features, out_features)
    a, scale_a, b, scale_b = cublas.cublas_operands(x, weight, scale, BLOCK)
    padded = -(-rows // 4) * 4
    assert a.shape == (padded, in_features) and scale_a.stride() == (1, padded)
    assert (a[rows:].view(torch.uint8) == 0).all() and (scale_a[rows:] == 1).all()  # padding rows
    with FakeTensorMode() as mode:  # torch's meta function for _scaled_mm_v2 checks shapes and strides
        fake_a, fake_scale_a, fake_b, fake_scale_b = (mode.from_tensor(t) for t in (a, scale_a, b, scale_b))
        out = F.scaled_mm(fake_a, fake_b, fake_scale_a, F.ScalingType.BlockWise1x128, fake_scale_b,
                          F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
    assert out.shape == (padded, out_features)


@pytest.mark.skipif(torch.__version__ < "2.13", reason="torch 2.11's meta function does not check the K-side "
                    "padding, 2.13's does; the padded operands pass both")
def test_an_unpadded_weight_scale_fails_torchs_check():
    """Why the K side of the weight's scales is padded: 9 K-blocks are not accepted as they are."""
    x, weight, scale = inputs(4, 1152, 1152)
    a, scale_a, b, _ = cublas.cublas_operands(x, weight, scale, BLOCK)
    unpadded = scale.t()  # [9, 9]: the weight's scales transposed, K side not padded to 12
    with FakeTensorMode() as mode, pytest.raises(RuntimeError, match="blockwise"):
        F.scaled_mm(mode.from_tensor(a), mode.from_tensor(b), mode.from_tensor(scale_a), F.ScalingType.BlockWise1x128,
                    mode.from_tensor(unpadded), F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)


@pytest.mark.parametrize("rows,in_features,out_features", SHAPES)
def test_row_wise_operands_pass_torchs_own_checks(rows, in_features, out_features):
    block = per_channel_block(in_features)
    x, weight, scale = inputs(rows, in_features, out_features, block=block)
    a, scale_a, b, scale_b = cublas.cublas_operands(x, weight, scale, block)
    padded = -(-rows // 4) * 4
    assert a.shape == (padded, in_features) and scale_a.shape == (padded, 1) and scale_b.shape == (1, out_features)
    with FakeTensorMode() as mode:
        fake_a, fake_scale_a, fake_b, fake_scale_b = (mode.from_tensor(t) for t in (a, scale_a, b, scale_b))
        out = F.scaled_mm(fake_a, fake_b, fake_scale_a, F.ScalingType.RowWise, fake_scale_b, F.ScalingType.RowWise,
                          output_dtype=torch.bfloat16, use_fast_accum=True)
    assert out.shape == (padded, out_features)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,in_features,out_features", SHAPES)
def test_the_documented_gemm_on_these_operands_matches_the_reference(
    hopper, dtype, rows, in_features, out_features, per_channel
):
    block = per_channel_block(in_features) if per_channel else BLOCK
    x, weight, scale = inputs(rows, in_features, out_features, dtype, block)
    bias = (torch.randn(out_features) * 0.1).to(dtype)
    expected = fp8_linear_reference(x, weight, scale, block, bias, fp8_activations=True)
    # tolerance: TOLERANCE[dtype] of max |expected|, as for the Triton kernel (the same operands,
    # float32 accumulation; one more rounding where the bias is added)
    assert_close(cublas.fp8_linear_cublas(x, weight, scale, bias, block=block), expected, rel=TOLERANCE[dtype])
    stacked = cublas.fp8_linear_cublas(x.view(1, rows, in_features), weight, scale, block=block)  # leading dims kept
    assert stacked.shape == (1, rows, out_features)
    assert cublas.fp8_linear_cublas(x[:0], weight, scale, block=block).shape == (0, out_features)


@pytest.mark.parametrize("per_channel", [False, True])
def test_row_pieces_give_the_bits_of_their_stack(hopper, per_channel):
    """A step's decode rows and prefill rows, quantized where they lie into one GEMM input: the
    same answer, bit for bit, as the stacked input (7 + 6 rows: the padding rows follow both)."""
    block = per_channel_block(256) if per_channel else BLOCK
    x, weight, scale = inputs(13, 256, 384, torch.bfloat16, block)
    pieces = [x[:7], x[7:]]
    stacked = cublas.fp8_linear_cublas(x, weight, scale, block=block)
    assert torch.equal(cublas.fp8_linear_cublas(pieces, weight, scale, block=block), stacked)
    for got, want in zip(cublas.cublas_operands(pieces, weight, scale, block), cublas.cublas_operands(x, weight, scale,
                                                                                                         block)):
        assert torch.equal(got.float(), want.float()) and got.stride() == want.stride()
    assert cublas.fp8_linear_cublas([x[:0], x[:0]], weight, scale, block=block).shape == (0, 384)


def test_fp8_linear_rows_quantizes_pieces_only_where_cublas_runs(monkeypatch):
    dense = importlib.import_module("kernels.fp8_linear")
    x, weight, scale = inputs(8, 256, 384)
    pieces = [x[:3], x[3:]]
    taken = []
    monkeypatch.setattr(dense, "use_triton", lambda *tensors, op: True)
    monkeypatch.setattr(cublas, "usable", lambda *args: True)
    monkeypatch.setattr(cublas, "fp8_linear_cublas", lambda rows, *args, block: taken.append(("cublas", rows)) or "c")
    monkeypatch.setattr(dense, "fp8_linear_triton", lambda rows, *args: taken.append(("triton", rows)) or "t")
    assert kernels.fp8_linear_rows(pieces, weight, scale, BLOCK, fp8_activations=True) == "c"
    assert taken.pop()[1] is pieces  # the pieces as they are
    assert kernels.fp8_linear_rows(pieces, weight, scale, BLOCK, fp8_activations=False) == "t"  # W8A16
    assert torch.equal(taken.pop()[1], x)  # stacked first
    monkeypatch.setattr(cublas, "usable", lambda *args: False)
    assert kernels.fp8_linear_rows(pieces, weight, scale, BLOCK, fp8_activations=True) == "t"
    assert torch.equal(taken.pop()[1], x)
    with pytest.raises(ValueError, match="at least one piece"):
        kernels.fp8_linear_rows([], weight, scale, BLOCK)


def test_the_first_call_check_runs_once_per_shape(hopper, monkeypatch):
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return documented_scaled_mm(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_mm", counting)
    x, weight, scale = inputs(8, 256, 384)
    assert cublas.usable(x, weight, scale, BLOCK) and cublas.usable(x, weight, scale, BLOCK)
    assert len(calls) == 1 and calls[0][0] == -(-cublas.PROBE_ROWS // 4) * 4  # the probe, with padding
    other = inputs(8, 512, 384)
    assert cublas.usable(other[0], other[1], other[2], BLOCK) and len(calls) == 2


def test_a_wrong_or_failing_gemm_keeps_the_triton_kernel_with_a_warning(hopper, monkeypatch, caplog):
    x, weight, scale = inputs(8, 256, 384)

    def scales_ignored(a, b, *args, output_dtype=torch.bfloat16, **kwargs):
        return (a.float() @ b.float()).to(output_dtype)

    monkeypatch.setattr(F, "scaled_mm", scales_ignored)
    with caplog.at_level(logging.WARNING, logger="kernels.fp8_linear_cublas"):
        assert not cublas.usable(x, weight, scale, BLOCK)
    assert "from the reference" in caplog.text

    def failing(*args, **kwargs):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(cublas, "_checked", {})
    monkeypatch.setattr(F, "scaled_mm", failing)
    with caplog.at_level(logging.WARNING, logger="kernels.fp8_linear_cublas"):
        assert not cublas.usable(x, weight, scale, BLOCK)
    assert "CUBLAS_STATUS_NOT_SUPPORTED" in caplog.text


def test_the_first_call_check_is_per_recipe_and_any_failure_keeps_triton(hopper, monkeypatch, caplog):
    """A row-wise weight is checked on the row-wise recipe under a key of its own, with fast
    accumulation only under VLM_CATALOG_FP8_FAST_ACCUMULATION (another key again); a failure of
    any kind (here a compile error's own class, not one of torch's) keeps the Triton kernel."""
    monkeypatch.delenv("VLM_CATALOG_FP8_FAST_ACCUMULATION", raising=False)
    recipes = []

    def recording(a, b, scale_a, recipe_a, *args, **kwargs):
        recipes.append((recipe_a, kwargs.get("use_fast_accum")))
        return documented_scaled_mm(a, b, scale_a, recipe_a, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_mm", recording)
    block = per_channel_block(256)
    x, weight, scale = inputs(8, 256, 384, block=block)
    assert cublas.usable(x, weight, scale, block) and cublas.usable(x, weight, scale, block)
    assert recipes == [(F.ScalingType.RowWise, False)]
    assert list(cublas._checked) == [(x.device, (384, 256), torch.bfloat16, block, False)]
    monkeypatch.setenv("VLM_CATALOG_FP8_FAST_ACCUMULATION", "1")
    assert cublas.usable(x, weight, scale, block) and cublas.usable(x, weight, scale, block)
    assert recipes == [(F.ScalingType.RowWise, False), (F.ScalingType.RowWise, True)]
    assert cublas.verdicts() == {"(384, 256) bfloat16 row-wise": True,
                                 "(384, 256) bfloat16 row-wise, fast accumulation": True}
    cublas.fp8_linear_cublas(x, weight, scale, block=block)
    assert recipes[-1] == (F.ScalingType.RowWise, True)
    monkeypatch.delenv("VLM_CATALOG_FP8_FAST_ACCUMULATION")
    cublas.fp8_linear_cublas(x, weight, scale, block=block)
    assert recipes[-1] == (F.ScalingType.RowWise, False)

    class CompilationError(Exception):  # not a RuntimeError, as triton.compiler.errors.CompilationError
        pass

    def failing(*args, **kwargs):
        raise CompilationError("arange's range must be a power of 2")

    monkeypatch.setattr(F, "scaled_mm", failing)
    other = inputs(8, 512, 384, block=per_channel_block(512))
    with caplog.at_level(logging.WARNING, logger="kernels.fp8_linear_cublas"):
        assert not cublas.usable(other[0], other[1], other[2], per_channel_block(512))
    assert "power of 2" in caplog.text and "row-wise" in caplog.text
    assert cublas.verdicts() == {"(384, 256) bfloat16 row-wise": True,
                                 "(384, 256) bfloat16 row-wise, fast accumulation": True,
                                 "(384, 512) bfloat16 row-wise": False}


def test_only_eligible_operands_and_devices_take_cublas(hopper, monkeypatch):
    x, weight, scale = inputs(8, 256, 384)
    assert cublas.eligible(x, weight, BLOCK)
    assert not cublas.eligible(x.float(), weight, BLOCK)  # float32 activations
    assert not cublas.eligible(x, weight, (64, 128))  # other weight blocks
    assert cublas.eligible(x, weight, per_channel_block(256))  # per-channel: row-wise scales
    assert not cublas.eligible(x, weight, (1, 128))  # rows of blocks that do not span K (256)
    odd_weight, _ = quantize(torch.randn(40, 256), BLOCK)
    assert not cublas.eligible(x, odd_weight, BLOCK)  # N not a multiple of 16
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "fp8_linear_cublas")
    assert not cublas.eligible(x, weight, BLOCK)
    monkeypatch.undo()
    assert not cublas.device_supported(torch.device("cpu"))


def test_fp8_linear_sends_w8a8_to_cublas_where_usable(monkeypatch):
    dense = importlib.import_module("kernels.fp8_linear")  # the module (kernels.fp8_linear is the function)

    x, weight, scale = inputs(8, 256, 384)
    taken = []
    monkeypatch.setattr(dense, "use_triton", lambda *tensors, op: True)
    monkeypatch.setattr(cublas, "usable", lambda *args: True)
    monkeypatch.setattr(cublas, "fp8_linear_cublas", lambda *args, block: taken.append(("cublas", block)) or "cublas")
    monkeypatch.setattr(dense, "fp8_linear_triton", lambda *args: taken.append(("triton", args[3])) or "triton")
    assert kernels.fp8_linear(x, weight, scale, BLOCK, fp8_activations=True) == "cublas"
    assert kernels.fp8_linear(x, weight, scale, (1, 256), fp8_activations=True) == "cublas"  # per-channel
    assert kernels.fp8_linear(x, weight, scale, BLOCK, fp8_activations=False) == "triton"  # W8A16: Triton
    monkeypatch.setattr(cublas, "usable", lambda *args: False)
    assert kernels.fp8_linear(x, weight, scale, BLOCK, fp8_activations=True) == "triton"
    # each GEMM gets the weight's own blocks: per-channel scales read as 128 x 128 blocks would be wrong
    assert taken == [("cublas", BLOCK), ("cublas", (1, 256)), ("triton", BLOCK), ("triton", BLOCK)]


# --------------------------------------------------------------------------- on a GPU
def on_hopper(device: torch.device) -> None:
    if not cublas.device_supported(device):
        pytest.skip("needs a Hopper GPU and a torch with block-scaled F.scaled_mm (2.10 or later)")


@pytest.mark.gpu
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 256, 4096])
@pytest.mark.parametrize("in_features,out_features", [(2048, 5120), (4096, 2048), (1152, 1152)])
def test_gpu_cublas_matches_the_reference(cuda_device, rows, in_features, out_features, per_channel):
    # tolerance: 1e-2 (bfloat16) of max |expected|; qkv_proj and o_proj of Qwen3-VL-30B-A3B, and
    # 9 K-blocks (the padded weight scales); per-channel: row-wise scales, fast accumulation
    on_hopper(cuda_device)
    block = per_channel_block(in_features) if per_channel else BLOCK
    x, weight, scale = (t.to(cuda_device) for t in inputs(rows, in_features, out_features, block=block))
    assert cublas.usable(x, weight, scale, block)  # the first-call check passed
    expected = fp8_linear_reference(x, weight, scale, block, fp8_activations=True)
    assert_close(cublas.fp8_linear_cublas(x, weight, scale, block=block), expected, rel=1e-2)


@pytest.mark.gpu
def test_gpu_cublas_replays_in_a_cuda_graph(cuda_device):
    on_hopper(cuda_device)
    x, weight, scale = (t.to(cuda_device) for t in inputs(8, 2048, 5120))
    eager = kernels.fp8_linear(x, weight, scale, BLOCK, fp8_activations=True)  # checks the shape, outside capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        captured = kernels.fp8_linear(x, weight, scale, BLOCK, fp8_activations=True)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(captured, eager, rel=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("per_channel", [False, True])
def test_gpu_row_pieces_give_the_bits_of_their_stack(cuda_device, per_channel):
    # o_proj of Qwen3-VL-30B-A3B in a mixed step: 256 decode rows, then 3,001 prefill rows (the
    # padding follows both). Exact: the pieces are quantized into the same operands, bit for bit.
    on_hopper(cuda_device)
    block = per_channel_block(4096) if per_channel else BLOCK
    x, weight, scale = (t.to(cuda_device) for t in inputs(3257, 4096, 2048, block=block))
    pieces = [x[:256], x[256:]]
    assert cublas.usable(x, weight, scale, block)
    assert torch.equal(kernels.fp8_linear_rows(pieces, weight, scale, block, fp8_activations=True),
                       cublas.fp8_linear_cublas(x, weight, scale, block=block))


@pytest.mark.gpu
@pytest.mark.fast_path("norm_quantizes")
@pytest.mark.parametrize("per_channel", [False, True])
def test_gpu_q_k_v_from_the_norm_s_fp8_input_as_from_its_16_bit_rows(cuda_device, per_channel):
    # q/k/v of Qwen3-VL-30B-A3B after a MoE layer: the norm of 8 terms and the residual writes
    # cuBLAS's FP8 input (4,099 rows: one padding row), against the same norm's 16-bit rows
    # quantized by the GEMM. Tolerance 1e-2 of max |expected| (bfloat16): the same FP8 values
    # (test_rms_norm_quantizes.py's GPU test counts any that differ), so expected exact.
    on_hopper(cuda_device)
    block = per_channel_block(2048) if per_channel else BLOCK
    _, weight, scale = (t.to(cuda_device) for t in inputs(1, 2048, 5120, block=block))
    terms = torch.randn(4099, 8, 2048, device=cuda_device).to(torch.bfloat16)
    residual = torch.randn(4099, 2048, device=cuda_device).to(torch.bfloat16)
    norm_weight = torch.rand(2048, device=cuda_device).to(torch.bfloat16) + 0.5
    layout = kernels.fp8_linear_input_layout(residual, weight, scale, block)
    assert layout == cublas.input_layout(block, 2048)  # cuBLAS runs, so it asks
    normed, _ = kernels.fused_sum_add_rms_norm(terms, residual, norm_weight, 1e-6)
    quantized, _ = kernels.fused_sum_add_rms_norm(terms, residual, norm_weight, 1e-6, layout)
    expected = kernels.fp8_linear(normed, weight, scale, block, fp8_activations=True)
    got = kernels.fp8_linear(quantized, weight, scale, block, fp8_activations=True)
    assert_close(got, expected, rel=1e-2)
    print(f"per_channel={per_channel}: bit for bit {torch.equal(got, expected)}")


# --------------------------------------------------------------------------- inputs quantized ahead
@pytest.mark.parametrize("per_channel", [False, True])
def test_an_input_quantized_ahead_gives_the_bits_of_its_16_bit_rows(hopper, monkeypatch, per_channel):
    """The norm before q/k/v writes the GEMM's FP8 input in `input_layout` (kernels/fp8_input.py):
    the GEMM's answer is the one it gives the 16-bit rows, bit for bit (5 rows: 3 padding rows)."""
    dense = importlib.import_module("kernels.fp8_linear")
    monkeypatch.setattr(dense, "use_triton", lambda *tensors, op: True)
    block = per_channel_block(256) if per_channel else BLOCK
    x, weight, scale = inputs(5, 256, 384, torch.bfloat16, block)
    layout = kernels.fp8_linear_input_layout(x, weight, scale, block)
    assert layout == cublas.input_layout(block, 256) and layout.row_multiple == cublas.ROW_MULTIPLE
    quantized = quantize_fp8_input(x, layout)
    expected = kernels.fp8_linear(x, weight, scale, block, fp8_activations=True)
    assert torch.equal(kernels.fp8_linear(quantized, weight, scale, block, fp8_activations=True), expected)
    for got, want in zip(cublas.cublas_operands(quantized, weight, scale, block),
                         cublas.cublas_operands(x, weight, scale, block)):
        assert torch.equal(got.float(), want.float()) and got.stride() == want.stride()
    empty = quantize_fp8_input(x[:0], layout)
    assert kernels.fp8_linear(empty, weight, scale, block, fp8_activations=True).shape == (0, 384)


def test_the_gemm_asks_for_its_input_quantized_only_where_cublas_runs(hopper, monkeypatch):
    dense = importlib.import_module("kernels.fp8_linear")
    x, weight, scale = inputs(8, 256, 384)
    assert kernels.fp8_linear_input_layout(x, weight, scale, BLOCK) is None  # on CPU: the reference GEMM
    monkeypatch.setattr(dense, "use_triton", lambda *tensors, op: True)
    assert kernels.fp8_linear_input_layout(x, weight, scale, BLOCK) == cublas.input_layout(BLOCK, 256)
    assert kernels.fp8_linear_input_layout(x.float(), weight, scale, BLOCK) is None  # cuBLAS takes 16 bits
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "norm_quantizes")
    assert kernels.fp8_linear_input_layout(x, weight, scale, BLOCK) is None
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "fp8_linear_cublas")
    assert kernels.fp8_linear_input_layout(x, weight, scale, BLOCK) is None


@pytest.mark.parametrize("per_channel", [False, True])
def test_an_input_quantized_ahead_off_cublas_takes_the_reference_arithmetic(per_channel):
    """Where cuBLAS no longer runs (turned off after the norm had written the input), the GEMM
    multiplies the same FP8 values as the reference does: its answer, bit for bit."""
    block = per_channel_block(256) if per_channel else BLOCK
    x, weight, scale = inputs(6, 256, 384, torch.bfloat16, block)
    bias = torch.randn(384).to(torch.bfloat16)
    quantized = quantize_fp8_input(x, cublas.input_layout(block, 256))
    expected = fp8_linear_reference(x, weight, scale, block, bias, fp8_activations=True)
    assert torch.equal(kernels.fp8_linear(quantized, weight, scale, block, bias, fp8_activations=True), expected)


def test_an_input_in_another_layout_is_refused(hopper):
    x, weight, scale = inputs(5, 256, 384)
    wrong = quantize_fp8_input(x, Fp8InputLayout(group=128, row_multiple=4))  # scales row-major
    with pytest.raises(ValueError, match="x: an FP8 input of group 128"):
        cublas.fp8_linear_cublas(wrong, weight, scale, block=BLOCK)
    unpadded = quantize_fp8_input(x, Fp8InputLayout(group=128, scales_row_index_fastest=True))
    with pytest.raises(ValueError, match="where cuBLAS takes"):
        cublas.fp8_linear_cublas(unpadded, weight, scale, block=BLOCK)
