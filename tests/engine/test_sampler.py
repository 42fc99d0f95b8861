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
     ({"regex": "a", "choice": ["b"]}, "at most one"), ({"choice": []}, "choice"), ({"logprobs": 99}, "logprobs"),
     # wrong types and seeds torch cannot take: refused here, not as a TypeError inside a step
     ({"seed": 2**63}, "seed"), ({"seed": -(2**63) - 1}, "seed"), ({"seed": "abc"}, "seed must be an integer"),
     ({"seed": 1.5}, "seed must be an integer"), ({"max_tokens": True}, "max_tokens must be an integer"),
     ({"max_tokens": None}, "max_tokens must be an integer, got None"),  # before: a TypeError
     ({"temperature": "0.5"}, "temperature must be a number"), ({"top_p": None}, "top_p must be a number"),
     ({"top_k": 2.0}, "top_k must be an integer"), ({"stop_token_ids": [1.0]}, "stop_token_ids"),
     ({"stop": 5}, "stop and stop_token_ids must be lists")],
)
def test_invalid_settings_are_named(kwargs, message):
    with pytest.raises(SamplingParamsError, match=message) as refused:
        SamplingParams(**kwargs)
    expected = "json_schema" if message == "at most one" else next(iter(kwargs))  # "at most one": the first
    assert refused.value.field == expected  # the service's `param` comes from it


def test_any_signed_64_bit_seed_draws_reproducibly():
    """OpenAI's API and vLLM take any int64 seed, and clients send -1; before, a negative seed was refused."""
    logits = logits_rows(rows=1)
    for seed in (-1, -(2**63), 2**63 - 1):
        params = SamplingParams(temperature=1.0, seed=seed)
        draws = [sample(logits.clone(), [params], [position]).token_ids[0] for position in range(30)]
        assert draws == [sample(logits.clone(), [params], [position]).token_ids[0] for position in range(30)]
        assert len(set(draws)) > 1  # a real draw per position, not one fixed token


def test_none_stop_lists_mean_no_stops_as_in_vllm():
    params = SamplingParams(stop=None, stop_token_ids=None, seed=2**63 - 1)
    assert params.stop == [] and params.stop_token_ids == []
    torch.Generator().manual_seed(params.seed)  # the largest seed allowed is one torch takes


def reference_probabilities(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The filtered distribution [V] the plain way: a full sort, top-k, then top-p and min-p
    on the probabilities left after top-k."""
    order = (logits_row / params.temperature).sort(descending=True)
    values, ids = order.values, order.indices
    keep = torch.ones_like(values, dtype=torch.bool)
    if params.top_k:
        keep[params.top_k:] = False
    probs = torch.softmax(values.masked_fill(~keep, float("-inf")), -1)
    keep &= probs.cumsum(0) - probs <= params.top_p
    keep &= probs >= params.min_p * probs[0]
    keep[0] = True
    return torch.zeros_like(values).index_copy_(0, ids, torch.softmax(values.masked_fill(~keep, float("-inf")), -1))


def sampled_distributions(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """What the sampler draws from, per row, on the whole vocabulary [R, V]."""
    from vlm_catalog.engine.sampler import filtered_distributions

    full = torch.zeros_like(logits)
    for group in filtered_distributions(logits, params):
        for position, row in enumerate(group.rows):
            ids = group.ids[position] if group.ids is not None else torch.arange(logits.shape[1])
            full[row].index_add_(0, ids, group.probs[position])
    return full


SETTINGS = {
    "generation_config": dict(temperature=0.7, top_k=20, top_p=0.8),
    "top_k": dict(temperature=1.3, top_k=7),
    "top_k_min_p": dict(temperature=1.0, top_k=30, min_p=0.1),
    "top_p": dict(temperature=1.0, top_p=0.6),
    "top_p_flat": dict(temperature=5.0, top_p=0.95),  # the window holds too little: the full-sort fallback
    "min_p": dict(temperature=1.0, min_p=0.2),
    "temperature": dict(temperature=0.9),
}


def test_each_filter_gives_the_distribution_of_a_full_sort(monkeypatch):
    """The sampler's groups (top-k by topk, top-p through a window of the best tokens or a
    full sort, no ranking at all), alone and batched together, filter as a full sort does
    (float64, to 1e-12)."""
    import vlm_catalog.engine.sampler as sampler

    monkeypatch.setattr(sampler, "NUCLEUS_WINDOW", 16)  # the window is smaller than the vocabulary here
    logits = torch.randn(len(SETTINGS), 200, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    params = [SamplingParams(**settings) for settings in SETTINGS.values()]
    expected = torch.stack([reference_probabilities(logits[row], p) for row, p in enumerate(params)])
    torch.testing.assert_close(sampled_distributions(logits, params), expected, rtol=0, atol=1e-12)
    for row, p in enumerate(params):
        torch.testing.assert_close(sampled_distributions(logits[row:row + 1], [p]), expected[row:row + 1], rtol=0, atol=1e-12)


def test_ranked_draws_follow_the_filtered_distribution():
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.9)
    expected = reference_probabilities(logits[0], params)
    generator = torch.Generator().manual_seed(5)
    trials = 6000
    counts = torch.zeros(6)
    for position in range(trials):
        counts[sample(logits, [params], [position], generator).token_ids[0]] += 1
    for p, observed in zip(expected.tolist(), (counts / trials).tolist()):
        assert abs(observed - p) < 4 * math.sqrt(p * (1 - p) / trials) + 1e-12


def test_a_uniform_next_to_one_still_draws_a_kept_token(monkeypatch):
    """Rounding u * total up to the total must not land past the last kept column
    (the columns beyond it, removed by the filters, share that cumulative value)."""
    import vlm_catalog.engine.sampler as sampler

    monkeypatch.setattr(sampler, "_uniforms", lambda params, *_: torch.full((len(params),), 1 - 2.0**-53, dtype=torch.float64))
    logits = logits_rows(3, 100)
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_k=50),
              SamplingParams(temperature=1.0, min_p=0.5)]
    picked = sample(logits.clone(), params, [0, 0, 0]).token_ids
    assert picked[0] in logits[0].topk(2).indices.tolist()
    probs = torch.softmax(logits[2], -1)
    assert probs[picked[2]] >= 0.5 * probs.max()


def test_the_nucleus_window_is_used_when_it_holds_the_mass_and_left_when_not(monkeypatch):
    import vlm_catalog.engine.sampler as sampler

    monkeypatch.setattr(sampler, "NUCLEUS_WINDOW", 16)
    sorts = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **k: sorts.append(self.shape) or real_sort(self, *a, **k))
    peaked = torch.full((1, 200), -10.0)
    peaked[0, :5] = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    sample(peaked, [SamplingParams(temperature=1.0, top_p=0.9)], [0])
    assert sorts == []
    sample(torch.zeros(1, 200), [SamplingParams(temperature=1.0, top_p=0.9)], [0])  # flat: 16 of 200 hold 8%
    assert sorts == [(1, 200)]


def test_seeded_rows_do_not_depend_on_the_other_rows_filters():
    logits = logits_rows(4, 60)
    seeded = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=3)
    alone = [sample(logits[1:2].clone(), [seeded], [position]).token_ids[0] for position in range(20)]
    others = [SamplingParams(temperature=1.0, top_k=50), seeded, SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=1.0)]
    for position in range(20):
        assert sample(logits.clone(), others, [position] * 4).token_ids[1] == alone[position]


def test_the_memory_profiles_path_draws_kept_tokens_over_a_full_sort(monkeypatch):
    """`sample_most_memory` (run by the memory profile) sorts the whole vocabulary and draws
    from the top-p 0.99 nucleus."""
    from vlm_catalog.engine.sampler import sample_most_memory

    sorts = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **k: sorts.append(self.shape) or real_sort(self, *a, **k))
    logits = logits_rows(3, 80)
    picked = sample_most_memory(logits).tolist()
    assert sorts == [(3, 80)]
    for row, token in enumerate(picked):
        assert reference_probabilities(logits[row], SamplingParams(temperature=1.0, top_p=0.99))[token] > 0
