"""Sampler: filters, seeds, batching and the distribution it draws from."""

import math

import pytest
import torch

from vlm_catalog.engine.sampler import sample
from vlm_catalog.engine.sampling_params import SamplingParams, SamplingParamsError


def logits_rows(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = logits_rows()
    argmax = logits.argmax(-1).tolist()
    for params in (SamplingParams(), SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6),
                   SamplingParams(temperature=1.0, min_p=1.0)):
        assert sample(logits.clone(), [params] * 4, [0] * 4, torch.Generator().manual_seed(1)).token_ids == argmax


def test_top_k_and_top_p_restrict_the_support():
    logits = logits_rows(1, 30)
    generator = torch.Generator().manual_seed(0)
    top3 = set(logits[0].topk(3).indices.tolist())
    draws = {sample(logits.clone(), [SamplingParams(temperature=2.0, top_k=3)], [i], generator).token_ids[0] for i in range(300)}
    assert draws <= top3 and len(draws) > 1
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.7).sum()) + 1].tolist())
    draws = {sample(logits.clone(), [SamplingParams(temperature=1.0, top_p=0.7)], [i], generator).token_ids[0] for i in range(300)}
    assert draws <= nucleus


def test_temperature_sampling_follows_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    generator = torch.Generator().manual_seed(3)
    counts = torch.zeros(4)
    trials = 6000
    for _ in range(trials):
        counts[sample(logits.clone(), [SamplingParams(temperature=1.0)], [0], generator).token_ids[0]] += 1
    expected = torch.softmax(logits[0], -1)
    # each frequency within 4 standard deviations of its probability
    for p, observed in zip(expected.tolist(), (counts / trials).tolist()):
        assert abs(observed - p) < 4 * math.sqrt(p * (1 - p) / trials)


def test_seeded_rows_depend_on_seed_and_position_only():
    logits = logits_rows(3, 40)
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = sample(logits[1:2].clone(), [seeded], [5]).token_ids[0]
    others = [SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0.5, seed=7)]
    for g in range(3):
        batch = sample(logits.clone(), others, [0, 5, 9], torch.Generator().manual_seed(g)).token_ids
        assert batch[1] == alone
    draws = {sample(logits[1:2].clone(), [seeded], [position]).token_ids[0] for position in range(40)}
    assert len(draws) > 1  # positions get different noise


def test_logprobs_report_the_sampled_token_and_top_alternatives():
    logits = logits_rows(2, 20)
    result = sample(logits.clone(), [SamplingParams(logprobs=2), SamplingParams()], [0, 0])
    entry = result.logprobs[0]
    log_probs = torch.log_softmax(logits[0], -1)
    assert result.logprobs[1] is None
    assert set(entry) == set(log_probs.topk(2).indices.tolist()) | {result.token_ids[0]}
    for token, value in entry.items():
        assert value == pytest.approx(float(log_probs[token]), abs=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
     ({"top_k": -5}, "top_k"), ({"min_p": 2}, "min_p"), ({"stop": [""]}, "stop"),
     ({"regex": "a", "choice": ["b"]}, "at most one"), ({"choice": []}, "choice"), ({"logprobs": 99}, "logprobs")],
)
def test_invalid_settings_are_named(kwargs, message):
    with pytest.raises(SamplingParamsError, match=message):
        SamplingParams(**kwargs)
