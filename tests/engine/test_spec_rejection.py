"""The rejection sampler keeps the target distribution: every emitted token of a
verify row is distributed as plain sampling would draw it (chi-square tests over
many seeds, on fixed logits and end to end on a tiny model), and greedy rows emit
exactly the sequential argmax."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxpar import LLM, SamplingParams
from ctxpar.engine.sample.rejection import DraftedHistory, verify_row
from ctxpar.engine.sample.sampler import apply_filters
from helpers.workloads import SMALL

NO_HISTORY = DraftedHistory([0], [], [], [])


def chi2_critical(df: int, z: float = 3.719) -> float:
    """The chi-square quantile of ``df`` degrees of freedom at the normal quantile z
    (3.719: p = 1e-4, Wilson-Hilferty), so a correct sampler fails 1 run in 10,000."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_goodness(counts: dict, probs: dict) -> tuple[float, int]:
    """Chi-square statistic of observed ``counts`` against expected ``probs`` (cells with
    an expected count under 5 pooled into one), and its degrees of freedom."""
    n = sum(counts.values())
    stat, pooled_obs, pooled_exp, cells = 0.0, 0.0, 0.0, 0
    for cell, p in probs.items():
        expected, observed = n * p, counts.get(cell, 0)
        if expected < 5:
            pooled_obs, pooled_exp = pooled_obs + observed, pooled_exp + expected
            continue
        stat += (observed - expected) ** 2 / expected
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    assert sum(c for k, c in counts.items() if k not in probs) == 0, "a token the target never draws"
    return stat, cells - 1


def test_verify_row_keeps_the_target_distribution():
    """Two drafts on fixed logits: the joint law of the emitted tokens is the target's,
    p0(x0) p1(x1) p2(x2) along kept drafts, with temperature and top-k applied."""
    g = torch.Generator().manual_seed(0)
    vocab, drafts = 6, [2, 4]
    logits = torch.randn(3, vocab, generator=g) * 1.5  # (k + 1, V)
    params = SamplingParams(temperature=0.8, top_k=4)
    p = [torch.softmax(apply_filters(logits[i], params), -1).tolist() for i in range(3)]
    # Expected law of the emitted sequence: walk the drafts while they are drawn.
    probs: dict[tuple[int, ...], float] = {}
    for x0 in range(vocab):
        if x0 != drafts[0]:
            probs[(x0,)] = p[0][x0]
            continue
        for x1 in range(vocab):
            if x1 != drafts[1]:
                probs[(x0, x1)] = p[0][x0] * p[1][x1]
                continue
            for x2 in range(vocab):
                probs[(x0, x1, x2)] = p[0][x0] * p[1][x1] * p[2][x2]
    probs = {k: v for k, v in probs.items() if v > 0}
    counts = Counter(
        tuple(verify_row(logits, drafts, params, torch.Generator().manual_seed(s), NO_HISTORY)) for s in range(6000)
    )
    stat, df = chi2_goodness(counts, probs)
    assert stat < chi2_critical(df), (stat, df)


def test_drafts_from_a_draft_distribution_keep_the_target_distribution():
    """A draft model's drafts: x ~ q, kept with probability min(1, p(x) / q(x)), else a
    token from max(p - q, 0). The first emitted token is distributed as p, whatever q."""
    g = torch.Generator().manual_seed(1)
    vocab = 6
    logits = torch.randn(2, vocab, generator=g) * 1.5  # (k + 1, V), k = 1
    q = torch.softmax(torch.randn(1, vocab, generator=g) * 1.5, -1)  # (k, V) the draft's distribution
    params = SamplingParams(temperature=1.0)
    p0 = torch.softmax(logits[0], -1).tolist()
    first = Counter()
    for s in range(6000):
        gen = torch.Generator().manual_seed(s)
        draft = int(torch.multinomial(q[0], 1, generator=gen))
        first[verify_row(logits, [draft], params, gen, NO_HISTORY, q)[0]] += 1
    stat, df = chi2_goodness(dict(first), dict(enumerate(p0)))
    assert stat < chi2_critical(df), (stat, df)


def test_a_draft_the_target_never_draws_is_always_rejected():
    logits = torch.tensor([[5.0, 4.0, 3.0, -2.0], [0.0, 0.0, 0.0, 0.0]])  # (2, 4)
    params = SamplingParams(temperature=1.0, top_k=2)  # token 3 is filtered out: p(3) = 0
    for s in range(200):
        out = verify_row(logits, [3], params, torch.Generator().manual_seed(s), NO_HISTORY)
        assert len(out) == 1 and out[0] in (0, 1)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 6), st.floats(0, 1))
def test_greedy_verify_is_the_sequential_argmax(seed, k, agree):
    """Drafts agree with the argmax for a while, then may not; the row emits the agreeing
    prefix plus the argmax at the first disagreement (or the bonus after all k)."""
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(rng.standard_normal((k + 1, 8)).astype(np.float32))
    best = torch.argmax(logits, -1).tolist()
    drafts = [best[i] if rng.random() < agree else int(rng.integers(0, 8)) for i in range(k)]
    want: list[int] = []
    for i in range(k + 1):
        want.append(best[i])
        if i == k or drafts[i] != best[i]:
            break
    greedy = SamplingParams(temperature=0)
    assert verify_row(logits, drafts, greedy, None, NO_HISTORY) == want
    # The per-position path (taken with logits processing) agrees with the vectorised one.
    neutral_bias = SamplingParams(temperature=0, logit_bias={0: 0.0})
    assert verify_row(logits, drafts, neutral_bias, None, NO_HISTORY) == want


def test_end_to_end_distribution_matches_plain_sampling(tiny_model_dirs):
    """Three tokens sampled with many seeds after a prompt the model itself wrote
    greedily (so n-gram drafts exist and are often, not always, right): the law of
    the triples matches the engine without speculation (two-sample chi-square)."""
    samples = 250
    params = [SamplingParams(temperature=0.8, top_k=2, seed=s, max_tokens=3, ignore_eos=True) for s in range(samples)]
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    counts = []
    with LLM(str(tiny_model_dirs["llama"]), max_num_seqs=samples, **SMALL) as llm:
        greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        own = llm.generate([{"prompt_token_ids": [7, 8, 9]}], greedy, use_tqdm=False)[0].outputs[0].token_ids
        prompts = [{"prompt_token_ids": [7, 8, 9, *own]}] * samples
        counts.append(Counter(tuple(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)))
    with LLM(str(tiny_model_dirs["llama"]), speculative_config=spec, max_num_seqs=samples, **SMALL) as llm:
        counts.append(Counter(tuple(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)))
        stats = llm.engine.spec.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    # Two-sample chi-square over the triples seen (rare ones pooled).
    stat, df, rare = 0.0, -1, [0, 0]
    for c in set(counts[0]) | set(counts[1]):
        a, b = counts[0].get(c, 0), counts[1].get(c, 0)
        if a + b < 10:
            rare[0], rare[1] = rare[0] + a, rare[1] + b
            continue
        stat += (a - b) ** 2 / (a + b)
        df += 1
    if sum(rare):
        stat += (rare[0] - rare[1]) ** 2 / sum(rare)
        df += 1
    assert df >= 3 and stat < chi2_critical(df), (stat, df)
