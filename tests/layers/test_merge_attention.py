"""merge_attention (ctxpar/layers/attention/torch_ops.py) on its own, against attention
over all keys at once.

The keys are split into parts (some empty, some with every key masked, so
their lse is -inf); each part's output and natural-log sum of exp scores are
computed here with plain torch, merged with merge_attention, and compared with
one softmax over all keys and ``torch.logsumexp`` of all scores. The layout is
the callers' (DCP, bottom_right_causal): outs (K, tokens, heads, Dv), lses
(K, tokens, heads), giving out (tokens, heads, Dv) and lse (tokens, heads).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxpar.layers.attention.torch_ops import merge_attention

NEG_INF = float("-inf")


def scores(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """q (T, H, D), k (S, H, D), allowed (T, H, S) -> scaled scores (T, H, S), -inf where not allowed."""
    s = torch.einsum("thd,shd->ths", q, k) / math.sqrt(q.shape[-1])
    return s.masked_fill(~allowed, NEG_INF)


def part_attention(s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the keys of one part: s (T, H, S_part) scores, v (S_part, H, Dv)
    -> out (T, H, Dv), lse (T, H). A query with no key (an empty part, or all
    masked) gets out 0 and lse -inf."""
    T, H, _ = s.shape
    lse = torch.full((T, H), NEG_INF, dtype=s.dtype)
    out = torch.zeros(T, H, v.shape[-1], dtype=s.dtype)
    if s.shape[-1] == 0:
        return out, lse
    lse = torch.logsumexp(s, dim=-1)
    some = lse.isfinite()
    p = torch.exp(s - torch.where(some, lse, 0.0).unsqueeze(-1))  # exactly 0 where masked
    out = torch.einsum("ths,shd->thd", p, v)
    out[~some] = 0.0
    return out, lse


def split_and_merge(s, v, part_of_key, parts, garbage=None):
    """Each part's attention computed on its own, then merged by merge_attention.
    ``garbage``: if given, the outputs of -inf parts are filled with it instead of 0
    (they must weigh nothing whatever they hold)."""
    outs, lses = [], []
    for p in range(parts):
        keys = (part_of_key == p).nonzero().flatten()
        o, l = part_attention(s[..., keys], v[keys])
        if garbage is not None:
            o = torch.where(l.isfinite().unsqueeze(-1), o, garbage[p])
        outs.append(o)
        lses.append(l)
    return merge_attention(torch.stack(outs), torch.stack(lses))


@st.composite
def problems(draw):
    T = draw(st.integers(1, 4))
    H = draw(st.integers(1, 3))
    D = draw(st.integers(1, 8))
    Dv = draw(st.integers(1, 8))
    S = draw(st.integers(0, 12))
    parts = draw(st.integers(1, 5))
    # Each key's part: parts no key falls in are empty.
    part_of_key = draw(st.lists(st.integers(0, parts - 1), min_size=S, max_size=S))
    # A part whose every key is masked for every query has lse -inf everywhere.
    masked_parts = draw(st.sets(st.integers(0, parts - 1), max_size=parts))
    mask_p = draw(st.sampled_from([0.0, 0.3, 0.7]))  # and keys masked at random, per query and head
    seed = draw(st.integers(0, 2**31 - 1))
    return T, H, D, Dv, S, parts, part_of_key, masked_parts, mask_p, seed


def make(T, H, D, Dv, S, parts, part_of_key, masked_parts, mask_p, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(T, H, D, generator=g, dtype=dtype)
    k = 2 * torch.randn(S, H, D, generator=g, dtype=dtype)
    v = torch.randn(S, H, Dv, generator=g, dtype=dtype)
    part_of_key = torch.tensor(part_of_key, dtype=torch.long)
    allowed = torch.rand(T, H, S, generator=g) >= mask_p
    for p in masked_parts:
        allowed[..., part_of_key == p] = False
    return q, k, v, part_of_key, allowed, g


def full_reference(s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over all keys; torch.logsumexp of all scores (-inf, and out 0, for a query with no key)."""
    lse = torch.logsumexp(s, dim=-1) if s.shape[-1] else torch.full(s.shape[:2], NEG_INF, dtype=s.dtype)
    out = (
        torch.einsum("ths,shd->thd", torch.softmax(s, dim=-1), v)
        if s.shape[-1]
        else torch.zeros(*s.shape[:2], v.shape[-1], dtype=s.dtype)
    )
    return torch.where(lse.isfinite().unsqueeze(-1), out, 0.0), lse  # softmax of all -inf is NaN: 0 wanted


@settings(max_examples=150, deadline=None)
@given(problems(), st.booleans())
def test_merge_equals_attention_over_all_keys(problem, garbage):
    T, H, D, Dv, S, parts = problem[:6]
    q, k, v, part_of_key, allowed, g = make(*problem)
    s = scores(q, k, allowed)
    junk = 1e3 * torch.randn(parts, T, H, Dv, generator=g, dtype=s.dtype) if garbage else None
    out, lse = split_and_merge(s, v, part_of_key, parts, junk)
    want_out, want_lse = full_reference(s, v)
    assert out.shape == (T, H, Dv) and lse.shape == (T, H)
    assert not out.isnan().any() and not lse.isnan().any()
    # -inf exactly where a query has no key at all; finite and equal elsewhere.
    assert torch.equal(lse.isneginf(), want_lse.isneginf())
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-12)


@settings(max_examples=40, deadline=None)
@given(problems())
def test_float32(problem):
    """The engine's dtype: fp32 partials merge to fp32 within fp32 rounding of the float64 reference."""
    T, H, D, Dv, S, parts = problem[:6]
    q, k, v, part_of_key, allowed, _ = make(*problem)
    s = scores(q, k, allowed)
    out, lse = split_and_merge(s.float(), v.float(), part_of_key, parts)
    want_out, want_lse = full_reference(s, v)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.equal(lse.isneginf(), want_lse.isneginf())
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(0, 5), st.integers(0, 2**31 - 1), st.sampled_from([-1e4, -80.0, 0.0, 90.0, 1e4]))
def test_one_finite_part_and_large_lses(parts, which, seed, shift):
    """All parts but one are -inf (whatever their outputs hold): the merge is that part,
    exactly, with no NaN, even where exp(lse) would overflow or underflow."""
    which = which % parts
    g = torch.Generator().manual_seed(seed)
    outs = 1e3 * torch.randn(parts, 3, 2, 4, generator=g, dtype=torch.float64)
    lses = torch.full((parts, 3, 2), NEG_INF, dtype=torch.float64)
    lses[which] = shift + torch.randn(3, 2, generator=g, dtype=torch.float64)
    out, lse = merge_attention(outs, lses)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, outs[which], atol=1e-9, rtol=1e-12)
    torch.testing.assert_close(lse, lses[which], atol=1e-9, rtol=1e-12)


@pytest.mark.parametrize("shift", [-1e4, -700.0, 0.0, 700.0, 1e4])
def test_shifted_lses(shift):
    """Adding c to every lse leaves out unchanged and adds c to the merged lse
    (a naive exp(lse) would underflow or overflow here)."""
    g = torch.Generator().manual_seed(7)
    outs = torch.randn(4, 5, 3, 6, generator=g, dtype=torch.float64)
    lses = 3 * torch.randn(4, 5, 3, generator=g, dtype=torch.float64)
    lses[1, 2] = NEG_INF  # one token-head where a part has no key
    out0, lse0 = merge_attention(outs, lses)
    out, lse = merge_attention(outs, lses + shift)
    w = torch.softmax(lses, dim=0)  # the reference weights, computed independently
    torch.testing.assert_close(out0, (w.unsqueeze(-1) * outs).sum(0), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse0, torch.logsumexp(lses, dim=0), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(out, out0, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(lse, lse0 + shift, atol=1e-9, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_parts_neg_inf_gives_zero_and_neg_inf(dtype):
    """As documented: if every part's lse is -inf, out is 0 and lse -inf, with no NaN,
    whatever the parts' outputs hold; other positions are unaffected."""
    g = torch.Generator().manual_seed(3)
    outs = torch.randn(3, 4, 2, 5, generator=g).to(dtype)
    lses = torch.randn(3, 4, 2, generator=g).to(dtype)
    lses[:, 1] = NEG_INF  # token 1: no key in any part
    lses[:, 3, 0] = NEG_INF  # token 3, head 0 too
    out, lse = merge_attention(outs, lses)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[1] == 0).all() and (out[3, 0] == 0).all()
    assert lse[1].isneginf().all() and lse[3, 0].isneginf()
    finite = lse.isfinite()
    assert finite.sum() == 4 * 2 - 2 - 1
    want = (torch.softmax(lses.double(), 0).unsqueeze(-1) * outs.double()).sum(0)
    torch.testing.assert_close(out[finite].double(), want[finite], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[finite].double(), torch.logsumexp(lses.double(), 0)[finite], atol=1e-5, rtol=1e-5)
    # Nothing at all: a single part holding no key.
    out, lse = merge_attention(torch.zeros(1, 2, 3, dtype=dtype), torch.full((1, 2), NEG_INF, dtype=dtype))
    assert (out == 0).all() and lse.isneginf().all()


def test_promoted_dtype():
    """out and lse come in the promoted dtype of outs and lses."""
    outs = torch.randn(2, 3, 4, dtype=torch.float32)
    lses = torch.randn(2, 3, dtype=torch.float64)
    out, lse = merge_attention(outs, lses)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    torch.testing.assert_close(lse, torch.logsumexp(lses, 0))
