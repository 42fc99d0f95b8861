"""What the model runner hands the model: integer MRoPE positions that match the prompt's."""

import pytest
import torch

from tests.engine.conftest import conversation
from vlm_catalog.engine.llm_engine import LLMEngine
from vlm_catalog.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(engine_checkpoint):
    engine = LLMEngine(model=engine_checkpoint, max_num_batched_tokens=512)
    yield engine
    engine.close()


def test_positions_reach_the_model_as_int64_in_prefill_only_and_mixed_steps(engine, monkeypatch):
    """A step without decodes once built float32 positions (torch.tensor([]) is float):
    the CPU path accepted them, the Triton MRoPE kernel did not."""
    seen: list[torch.Tensor] = []
    forward = engine.model.forward

    def recording_forward(input_ids, positions, attention, multimodal=None):
        seen.append(positions)
        return forward(input_ids, positions, attention, multimodal)

    monkeypatch.setattr(engine.model, "forward", recording_forward)
    first = engine.add_request(conversation(0, images=1, words=4), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # prefill only (no decodes yet)
    engine.add_request(conversation(1, images=2, words=3), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # the first request decodes, the second prefills: a mixed step
    while engine.has_unfinished_requests():
        engine.step()

    assert len(seen) >= 3
    assert all(p.dtype == torch.int64 and p.dim() == 2 and p.shape[0] == 3 for p in seen)
    prefill_positions = seen[0]
    prompt = engine.processor.process(conversation(0, images=1, words=4))
    assert torch.equal(prefill_positions, prompt.positions)
    assert first  # the request id was issued


def test_the_mrope_wrapper_refuses_float_positions_on_every_path():
    from kernels.rotary import qk_norm_mrope

    q = torch.randn(4, 2, 8)
    k = torch.randn(4, 1, 8)
    weight = torch.ones(8)
    inv_freq = torch.rand(4)
    with pytest.raises(ValueError, match="positions: dtype torch.float32"):
        qk_norm_mrope(q, k, weight, weight, torch.zeros(3, 4), inv_freq, (2, 1, 1), 1e-6)
