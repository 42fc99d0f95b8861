"""route_topk: reference vs transformers' router, Triton vs reference."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.moe.routing import route_topk_reference, route_topk_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_transformers_router(dtype):
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextTopKRouter

    config = Qwen3VLMoeTextConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4)
    router = Qwen3VLMoeTextTopKRouter(config).to(dtype)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32))
        hidden = torch.randn(7, 32, dtype=dtype)
        logits, scores, indices = router(hidden)
    weights, ids = route_topk_reference(logits, 4, renormalize=True)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    torch.testing.assert_close(
        weights.to(dtype), scores, rtol=0, atol=0
    )  # transformers casts to the logits dtype
    assert torch.equal(ids, indices.to(torch.int32))


def test_reference_renormalize_flag():
    logits = torch.randn(5, 10)
    probs = torch.softmax(logits.double(), dim=-1)
    raw, ids = route_topk_reference(logits, 3, renormalize=False)
    torch.testing.assert_close(raw.double(), probs.gather(1, ids.long()), rtol=1e-6, atol=1e-7)
    renormed, _ = route_topk_reference(logits, 3, renormalize=True)
    torch.testing.assert_close(renormed.sum(-1), torch.ones(5), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k", [(1, 8, 2), (9, 128, 8), (5, 60, 4), (3, 6, 6)]
)
def test_triton_route_topk(
    triton_device, poison_allocations, dtype, renormalize, num_tokens, num_experts, top_k
):
    # tolerance: weights 1e-6 relative (float32 softmax either way); ids exact up to ties, so the
    # check is that the chosen experts carry the reference's probabilities, largest first
    logits = torch.randn(num_tokens, num_experts).to(dtype).to(triton_device)
    weights, ids = kernels.route_topk(logits, top_k, renormalize)
    expected_weights, expected_ids = route_topk_reference(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)
    probs = torch.softmax(logits.float(), dim=-1)
    torch.testing.assert_close(
        probs.gather(1, ids.long()), probs.gather(1, expected_ids.long()), rtol=1e-6, atol=1e-7
    )
    assert all(len(set(row)) == top_k for row in ids.tolist()), "an expert was picked twice"
    assert (weights[:, :-1] >= weights[:, 1:]).all(), "weights must be sorted, largest first"


@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float16])
def test_weights_in_the_hidden_dtype_are_the_float32_weights_rounded_once(triton_device, weights_dtype):
    # the model asks for the hidden dtype (transformers casts the float32 weights to it): the
    # Triton store rounds once as torch's cast does. float32 logits: no ties, so the same experts.
    # tolerance: the reference exactly; Triton within one unit of weights_dtype (its float32 softmax
    # may differ from torch's in the last float32 bits, which can flip a rounding)
    logits = torch.randn(33, 128).to(triton_device)
    float32_weights, float32_ids = route_topk_reference(logits, 8, True)
    expected = float32_weights.to(weights_dtype)
    weights, ids = route_topk_reference(logits, 8, True, weights_dtype)
    assert weights.dtype == weights_dtype and torch.equal(weights, expected)
    weights, ids = kernels.route_topk(logits, 8, True, weights_dtype)
    assert weights.dtype == weights_dtype and torch.equal(ids, float32_ids)
    unit = torch.finfo(weights_dtype).eps
    torch.testing.assert_close(weights.float(), expected.float(), rtol=unit, atol=0)


def test_triton_rejects_a_weights_dtype_it_cannot_write(triton_device):
    with pytest.raises(ValueError, match="weights_dtype"):
        route_topk_triton(torch.randn(2, 4, device=triton_device), 2, True, torch.int32)


def test_triton_rejects_bad_top_k(triton_device):
    with pytest.raises(ValueError, match="top_k"):
        route_topk_triton(torch.randn(2, 4, device=triton_device), 5, True)


@pytest.mark.gpu
def test_gpu_route_topk(cuda_device):
    logits = torch.randn(8192, 128, device=cuda_device, dtype=torch.bfloat16)
    weights, _ = kernels.route_topk(logits, 8, True)
    expected_weights, _ = route_topk_reference(logits, 8, True)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)
