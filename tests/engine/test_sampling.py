"""Sampler: seeds, batch independence, top-k/top-p/min-p support, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from ctxpar.engine.sample.sampler import Sampler, apply_filters, compute_logprobs, pick, top_p_filter
from ctxpar.sampling_params import SamplingParams

PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
LOGITS = PROBS.log() + 1.7  # an offset changes nothing after softmax


def draw(params: SamplingParams, n: int = 3000, seed: int = 0) -> Counter:
    g = torch.Generator().manual_seed(seed)
    sampler = Sampler()
    logits = LOGITS.expand(n, -1).contiguous()
    # One generator shared by all rows drawn in sequence: n independent samples.
    out = sampler(logits, [params] * n, [g] * n)
    return Counter(out.token_ids)


def gens(*seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_greedy_is_argmax():
    logits = torch.randn(6, 50)
    out = Sampler()(logits, [SamplingParams(temperature=0)] * 6, [None] * 6)
    assert out.token_ids == logits.argmax(-1).tolist() and out.logprobs == [None] * 6


def test_same_seed_same_tokens_different_seed_differs():
    torch.manual_seed(0)
    logits = torch.randn(30, 1000)
    p = SamplingParams(temperature=1.0)
    g1, g2, g3 = gens(7, 7, 8)
    run1 = [Sampler()(logits[i : i + 1], [p], [g1]).token_ids[0] for i in range(30)]
    run2 = [Sampler()(logits[i : i + 1], [p], [g2]).token_ids[0] for i in range(30)]
    run3 = [Sampler()(logits[i : i + 1], [p], [g3]).token_ids[0] for i in range(30)]
    assert run1 == run2
    assert run1 != run3


def test_independent_of_batch_composition():
    torch.manual_seed(1)
    logits = torch.randn(5, 300)
    params = [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.3, top_k=20),
        SamplingParams(temperature=0.7, top_p=0.9, logprobs=2),
        SamplingParams(temperature=1.0, min_p=0.05),
    ]
    together = Sampler()(logits, params, gens(1, 2, 3, 4, 5)).token_ids
    alone = [Sampler()(logits[i : i + 1], [params[i]], gens(i + 1)).token_ids[0] for i in range(5)]
    reordered = Sampler()(logits.flip(0), params[::-1], gens(5, 4, 3, 2, 1)).token_ids[::-1]
    assert together == alone == reordered


def test_plain_sampling_follows_the_distribution():
    counts = draw(SamplingParams(temperature=1.0), n=4000)
    for t, p in enumerate(PROBS.tolist()):
        assert abs(counts[t] / 4000 - p) < 0.035, (t, counts)


@pytest.mark.parametrize(
    "params, support",
    [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_k=1), {0}),
        (SamplingParams(top_p=0.75), {0, 1, 2}),  # 0.4 + 0.3 < 0.75: the third is needed
        (SamplingParams(top_p=0.35), {0}),
        (SamplingParams(min_p=0.5), {0, 1}),  # keep p >= 0.2
        (SamplingParams(min_p=0.3), {0, 1, 2}),  # keep p >= 0.12
        (SamplingParams(top_k=3, top_p=0.6), {0, 1}),
    ],
)
def test_filters_restrict_the_support(params, support):
    counts = draw(params)
    assert set(counts) == support
    # Within the support the probabilities are renormalised, not reshaped.
    mass = sum(PROBS[t].item() for t in support)
    for t in support:
        assert abs(counts[t] / 3000 - PROBS[t].item() / mass) < 0.04, (params, counts)


@pytest.mark.parametrize("temperature", [0.2, 5.0])
def test_temperature_reshapes_the_distribution(temperature):
    counts = draw(SamplingParams(temperature=temperature))
    expected = PROBS ** (1 / temperature)
    expected = expected / expected.sum()  # softmax(logits / T)
    for t, p in enumerate(expected.tolist()):
        assert abs(counts[t] / 3000 - p) < 0.035, (temperature, counts)


def test_apply_filters_masks_with_minus_inf():
    x = apply_filters(LOGITS, SamplingParams(top_k=2))
    assert torch.isinf(x[2:]).all() and torch.isfinite(x[:2]).all()


def test_logprobs_match_log_softmax_of_raw_logits():
    torch.manual_seed(2)
    logits = torch.randn(3, 64) * 3
    params = [
        SamplingParams(temperature=0.5, logprobs=5),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=2.0, logprobs=3),
    ]
    out = Sampler()(logits, params, gens(1, 2, 3))
    ref = torch.log_softmax(logits, -1)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        n = params[i].logprobs
        top = set(ref[i].topk(n).indices.tolist()) if n else set()
        assert set(lp) == top | {tok}
        for t, v in lp.items():
            assert math.isclose(v.logprob, ref[i, t].item(), abs_tol=1e-5)
            assert v.rank == 1 + int((ref[i] > ref[i, t]).sum())
    [(t1, v1)] = out.logprobs[1].items()
    assert t1 == out.token_ids[1] and v1.logprob == pytest.approx(ref[1].max().item(), abs=1e-5) and v1.rank == 1


def test_compute_logprobs_includes_an_unlikely_sampled_token():
    lp = compute_logprobs(LOGITS, 4, 2)
    assert list(lp) == [4, 0, 1]  # the sampled token first, then the top-n, as vLLM orders them
    assert math.isclose(lp[4].logprob, math.log(0.05), abs_tol=1e-5)
    assert [v.rank for v in lp.values()] == [5, 1, 2]


def test_pick_never_lands_on_a_zero_weight():
    # u = 0 must skip leading zeros; the largest uniform a float64 draw gives, trailing ones.
    w = torch.tensor([0.0, 0.0, 2.0, 0.0, 3.0, 0.0, 0.0])
    assert pick(w, 0.0) == 2
    assert pick(w, 1 - 2**-53) == 4
    assert pick(w, 0.4) == 4  # u x 5 = 2.0: the running total at index 2 no longer exceeds it
    assert pick(w, math.nextafter(0.4, 0)) == 2


def test_pick_is_the_inverse_of_the_running_total():
    # Every index is chosen on its share of [0, 1), for unnormalised weights too (points a
    # hair inside each share: u x sum at an edge itself may round to either side).
    gen = torch.Generator().manual_seed(3)
    w = torch.rand(40, generator=gen) * (torch.rand(40, generator=gen) > 0.3)  # some zeros
    edges = (torch.cumsum(w.double(), 0) / w.double().sum()).tolist()
    lo = 0.0
    for i, hi in enumerate(edges):
        if hi > lo:
            for u in (lo + 1e-9 * (hi - lo), (lo + hi) / 2, hi - 1e-9 * (hi - lo)):
                assert pick(w, u) == i, (i, u)
        lo = hi


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_pick_refuses_what_is_not_a_distribution(bad):
    with pytest.raises(RuntimeError, match="inf or nan"):
        pick(torch.tensor([0.2, bad, 0.3]), 0.5)
    with pytest.raises(RuntimeError, match="sums to 0"):
        pick(torch.zeros(4), 0.5)


@pytest.mark.parametrize("scale, top_p", [(0.5, 0.9), (3.0, 0.9), (3.0, 0.5), (8.0, 0.95), (8.0, 0.2)])
def test_top_p_cut_matches_a_full_sort(scale, top_p):
    # The nucleus found over growing top-k candidates equals the rule applied to the whole
    # sorted vocabulary; flat rows (scale 0.5) need thousands of candidates, peaked ones few.
    gen = torch.Generator().manual_seed(int(scale * 10))
    x = torch.randn(20_000, generator=gen) * scale
    probs = torch.softmax(x.double(), 0)
    order = torch.argsort(probs, descending=True)
    before = torch.cumsum(probs[order], 0) - probs[order]
    expected = torch.zeros_like(x, dtype=torch.bool)
    expected[order[before < top_p]] = True
    got = top_p_filter(x, top_p)
    assert torch.equal(torch.isfinite(got), expected)
    assert torch.equal(got[expected], x[expected])
