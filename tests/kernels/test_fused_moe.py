"""fused_moe: reference vs transformers' experts loop and a float64 dense computation;
Triton vs reference over shapes, dtypes and block configs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.moe.configs import MoeKernelConfig
from kernels.moe.fused_moe import fused_moe_reference, fused_moe_triton
from kernels.moe.routing import route_topk_reference
from tests.kernels.helpers import TOLERANCE, assert_close


def moe_inputs(num_tokens, hidden, intermediate, num_experts, top_k, dtype, device):
    hidden_states = torch.randn(num_tokens, hidden).to(dtype).to(device)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden) * hidden**-0.5).to(dtype).to(device)
    w2 = (torch.randn(num_experts, hidden, intermediate) * intermediate**-0.5).to(dtype).to(device)
    weights, ids = route_topk_reference(
        torch.randn(num_tokens, num_experts).to(device), top_k, True
    )
    return hidden_states, w13, w2, weights, ids


def float64_moe(hidden, w13, w2, weights, ids) -> torch.Tensor:
    """Every expert for every token in float64, then the routed combination."""
    intermediate = w2.shape[2]
    gate_up = torch.einsum("th,enh->ten", hidden.double(), w13.double())  # [T, E, 2I]
    activated = F.silu(gate_up[..., :intermediate]) * gate_up[..., intermediate:]  # [T, E, I]
    expert_out = torch.einsum("tei,ehi->teh", activated, w2.double())  # [T, E, H]
    chosen = expert_out.gather(
        1, ids.long()[..., None].expand(-1, -1, hidden.shape[1])
    )  # [T, K, H]
    return (chosen * weights.double()[..., None]).sum(1)  # [T, H]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_transformers_experts_bitwise(dtype):
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

    config = Qwen3VLMoeTextConfig(
        hidden_size=32, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24
    )
    block = Qwen3VLMoeTextSparseMoeBlock(config).to(dtype)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.copy_(torch.randn(parameter.shape) * 0.3)
        hidden = torch.randn(1, 13, 32, dtype=dtype)
        expected = block(hidden)[0]
        logits = F.linear(hidden[0], block.gate.weight)
    weights, ids = route_topk_reference(logits, 3, renormalize=True)
    out = fused_moe_reference(
        hidden[0],
        block.experts.gate_up_proj.detach(),
        block.experts.down_proj.detach(),
        weights,
        ids,
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_reference_against_float64():
    # tolerance: 1e-5 relative (float32)
    inputs = moe_inputs(9, 24, 16, 5, 2, torch.float32, "cpu")
    assert_close(fused_moe_reference(*inputs), float64_moe(*inputs), rel=1e-5)


SMALL = MoeKernelConfig(
    block_size_m=16, block_size_n=16, block_size_k=16, group_size_m=2, num_warps=4, num_stages=2
)
CASES = [
    # (T, H, I, E, K, config)
    (11, 40, 24, 6, 3, SMALL),  # odd sizes: masks on every edge
    (1, 64, 32, 32, 8, SMALL),  # one decode token, 8 of 32 experts: mostly padded M blocks
    (33, 32, 48, 4, 2, MoeKernelConfig(32, 32, 16, 1, 4, 2)),  # several M blocks per expert
    (6, 48, 20, 8, 2, None),  # default config from the table / heuristic
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens,hidden,intermediate,num_experts,top_k,config", CASES)
def test_triton_fused_moe(
    triton_device,
    poison_allocations,
    dtype,
    num_tokens,
    hidden,
    intermediate,
    num_experts,
    top_k,
    config,
):
    # tolerance: TOLERANCE[dtype] (float32 1e-4, 16-bit 1e-2), max-norm relative
    inputs = moe_inputs(num_tokens, hidden, intermediate, num_experts, top_k, dtype, triton_device)
    out = kernels.fused_moe(*inputs, config=config)
    assert out.dtype == dtype
    assert_close(out, fused_moe_reference(*inputs), rel=TOLERANCE[dtype])


def test_triton_weights_in_another_dtype_and_config_as_dict(triton_device):
    """bf16 routing weights with float32 activations (multiplied in the hidden dtype)."""
    hidden, w13, w2, weights, ids = moe_inputs(7, 32, 16, 4, 2, torch.float32, triton_device)
    weights = weights.to(torch.bfloat16)
    config = {
        "block_size_m": 16,
        "block_size_n": 16,
        "block_size_k": 32,
        "group_size_m": 1,
        "num_warps": 4,
        "num_stages": 2,
    }
    assert_close(
        fused_moe_triton(hidden, w13, w2, weights, ids, config),
        fused_moe_reference(hidden, w13, w2, weights, ids),
        rel=1e-4,
    )


def test_triton_rejects_bad_arguments(triton_device):
    hidden, w13, w2, weights, ids = moe_inputs(4, 16, 8, 4, 2, torch.float32, triton_device)
    with pytest.raises(ValueError, match="w2"):
        fused_moe_triton(hidden, w13, w2[:, :, :4], weights, ids)
    with pytest.raises(ValueError, match="w13"):
        fused_moe_triton(hidden, w13.to(torch.bfloat16), w2, weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe_triton(hidden, w13, w2, weights, ids[:, :1])


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 256, 4096])
def test_gpu_fused_moe_model_shapes(cuda_device, num_tokens):
    # tolerance: 1e-2 (bfloat16); Qwen3-VL-30B-A3B expert shapes
    inputs = moe_inputs(num_tokens, 2048, 768, 128, 8, torch.bfloat16, cuda_device)
    assert_close(kernels.fused_moe(*inputs), fused_moe_reference(*inputs), rel=1e-2)
