"""linear_gelu_tanh: the reference against float64, the dispatch to cuBLASLt's GELU epilogue
(CUDA only: `_addmm_activation`'s CPU kernel is the erf GELU), and on a GPU the epilogue
against the reference."""

from __future__ import annotations

import math

import pytest
import torch

import kernels
from kernels import linear_gelu
from kernels.linear_gelu import (
    epilogue_wanted,
    linear_gelu_tanh,
    linear_gelu_tanh_epilogue,
    linear_gelu_tanh_reference,
)
from tests.kernels.helpers import FLOAT32_TOLERANCE, HALF_TOLERANCE, assert_close


def gelu_tanh_float64(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    pre = x.double() @ weight.double().T + bias.double()
    return 0.5 * pre * (1 + torch.tanh(math.sqrt(2 / math.pi) * (pre + 0.044715 * pre**3)))


def operands(rows: int, width: int, out: int, dtype=torch.float32, device="cpu"):
    x = torch.randn(rows, width) * 2
    weight = torch.randn(out, width) * width**-0.5
    bias = torch.randn(out)
    return tuple(t.to(dtype).to(device) for t in (x, weight, bias))


def test_reference_is_the_tanh_gelu_of_the_projection():
    # tolerance: 1e-4 relative (float32) against float64
    x, weight, bias = operands(33, 24, 40)
    assert_close(linear_gelu_tanh_reference(x, weight, bias), gelu_tanh_float64(x, weight, bias),
                 rel=FLOAT32_TOLERANCE)


def test_on_cpu_the_reference_runs(monkeypatch):
    calls = []
    monkeypatch.setattr(linear_gelu, "linear_gelu_tanh_epilogue", lambda *args: calls.append(args))
    x, weight, bias = operands(5, 16, 8, torch.bfloat16)
    got = kernels.linear_gelu_tanh(x, weight, bias)
    torch.testing.assert_close(got, linear_gelu_tanh_reference(x, weight, bias), rtol=0, atol=0)
    assert calls == []


def test_cpus_addmm_activation_is_the_erf_gelu_so_it_must_not_run_there():
    # why EPILOGUE_DEVICE_TYPES is CUDA only: torch's CPU kernel applies the exact GELU, which
    # differs from the tanh one by up to about 5e-4 (float32 here, so visible)
    x, weight, bias = operands(64, 16, 32)
    expected = linear_gelu_tanh_reference(x, weight, bias)
    difference = (linear_gelu_tanh_epilogue(x, weight, bias) - expected).abs().max().item()
    assert difference > 1e-5


@pytest.fixture
def epilogue_on_cpu(monkeypatch):
    """The CUDA choices on CPU tensors, no shape checked yet, the epilogue replaced by a recorder
    that runs the reference."""
    monkeypatch.setattr(linear_gelu, "EPILOGUE_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(linear_gelu, "_checked", {})
    calls = []

    def recorder(x, weight, bias):
        calls.append((x.shape, weight.shape, bias.shape))
        return linear_gelu_tanh_reference(x, weight, bias)

    monkeypatch.setattr(linear_gelu, "linear_gelu_tanh_epilogue", recorder)
    return calls


def test_the_epilogue_takes_two_dimensional_calls_with_a_bias_once_checked(epilogue_on_cpu, monkeypatch):
    monkeypatch.setattr(linear_gelu, "PROBE_ROWS", 4)
    x, weight, bias = operands(7, 16, 8, torch.bfloat16)
    expected = linear_gelu_tanh_reference(x, weight, bias)
    for rows in (7, 3):  # the first call checks its first PROBE_ROWS rows, then runs the epilogue
        assert torch.equal(linear_gelu_tanh(x[:rows], weight, bias), expected[:rows])
    assert epilogue_on_cpu == [((4, 16), (8, 16), (8,)), ((7, 16), (8, 16), (8,)), ((3, 16), (8, 16), (8,))]
    assert linear_gelu.verdicts() == {"(8, 16) bfloat16": True}


@pytest.mark.parametrize("failure", ["raises", "wrong numbers"])
def test_a_shape_the_epilogue_fails_keeps_the_reference(monkeypatch, caplog, failure):
    monkeypatch.setattr(linear_gelu, "EPILOGUE_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(linear_gelu, "_checked", {})
    calls = []

    def broken(x, weight, bias):
        calls.append(x.shape)
        if failure == "raises":
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        return linear_gelu_tanh_reference(x, weight, bias) + 1.0

    monkeypatch.setattr(linear_gelu, "linear_gelu_tanh_epilogue", broken)
    x, weight, bias = operands(5, 16, 8)
    expected = linear_gelu_tanh_reference(x, weight, bias)
    with caplog.at_level("WARNING", logger="kernels.linear_gelu"):
        for _ in range(3):
            assert torch.equal(linear_gelu_tanh(x, weight, bias), expected)
    assert len(calls) == 1  # the check only
    assert linear_gelu.verdicts() == {"(8, 16) float32": False}
    assert "the GELU GEMM epilogue" in caplog.text and "F.linear then F.gelu run" in caplog.text


@pytest.mark.parametrize("case", ["three-dimensional input", "no rows", "no bias", "gradient wanted"])
def test_calls_the_epilogue_cannot_take_run_the_reference(epilogue_on_cpu, case):
    x, weight, bias = operands(6, 16, 8)
    if case == "three-dimensional input":
        x = x.view(2, 3, 16)
    elif case == "no rows":
        x = x[:0]
    elif case == "no bias":
        bias = None
    else:
        weight.requires_grad_(True)
    assert not epilogue_wanted(x, weight, bias)
    got = linear_gelu_tanh(x, weight, bias)
    torch.testing.assert_close(got, linear_gelu_tanh_reference(x, weight, bias), rtol=0, atol=0)
    assert epilogue_on_cpu == [] and linear_gelu.verdicts() == {}  # nothing checked either
    if case == "gradient wanted":
        got.sum().backward()
        assert weight.grad is not None


def test_mixed_dtypes_are_not_the_epilogues(epilogue_on_cpu):
    x, weight, bias = operands(6, 16, 8)
    assert not epilogue_wanted(x.to(torch.bfloat16), weight, bias)
    assert not epilogue_wanted(x, weight, bias.to(torch.bfloat16))


@pytest.mark.parametrize("setting", [("VLM_CATALOG_KERNELS_OFF", "gelu_gemm_epilogue"),
                                     ("VLM_CATALOG_KERNELS", "reference")])
def test_the_off_switch_and_the_reference_backend_keep_the_reference(epilogue_on_cpu, monkeypatch, setting):
    monkeypatch.setenv(*setting)
    x, weight, bias = operands(4, 16, 8)
    linear_gelu_tanh(x, weight, bias)
    assert epilogue_on_cpu == []


def test_the_vision_mlp_goes_through_it(epilogue_on_cpu):
    from vlm_catalog.model.config import VisionConfig
    from vlm_catalog.model.vision import VisionMLP

    config = VisionConfig(
        depth=1, hidden_size=16, intermediate_size=24, num_heads=2, in_channels=3, patch_size=4,
        temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=16, num_position_embeddings=16,
        deepstack_visual_indexes=(), hidden_act="gelu_pytorch_tanh", rope_theta=10000.0,
    )
    mlp = VisionMLP(config)
    with torch.no_grad():
        mlp(torch.randn(5, 16))  # checked, then run
        mlp(torch.randn(4, 16))
    assert epilogue_on_cpu == [((5, 16), (24, 16), (24,))] * 2 + [((4, 16), (24, 16), (24,))]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 4096])
def test_gpu_epilogue_matches_the_reference(dtype, rows):
    # tolerance: HALF_TOLERANCE for bf16 (the epilogue applies GELU before rounding, the reference
    # after); 1e-5 relative in float32, where it must also be the tanh GELU, not the erf one
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x, weight, bias = operands(rows, 1152, 4304, dtype, "cuda")
    with torch.no_grad():
        assert epilogue_wanted(x, weight, bias)
        linear_gelu_tanh(x, weight, bias)  # the first call of a shape checks the epilogue
        assert linear_gelu.verdicts()[f"(4304, 1152) {str(dtype).removeprefix('torch.')}"]
        got = linear_gelu_tanh(x, weight, bias)
    expected = gelu_tanh_float64(x, weight, bias)
    assert got.dtype == dtype and got.shape == (rows, 4304)
    assert_close(got, expected, rel=HALF_TOLERANCE if dtype == torch.bfloat16 else 1e-5)
    assert_close(linear_gelu_tanh_epilogue(x, weight, bias), expected,
                 rel=HALF_TOLERANCE if dtype == torch.bfloat16 else 1e-5, what="the epilogue itself")
