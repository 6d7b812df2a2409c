"""bf16 prefill attention on AMX-BF16's tiles (ctxpar/kernels/prefill_tiles.cpp):
against float64 attention over the same bf16 values, within the bound that rounding
the softmax weights to bf16 allows; a query's bits whatever queries share its call
(chunks anywhere, key counts); and the layers' path taking it for bf16 inputs.
On a CPU without AMX-BF16 bf16 is widened into the float32 kernel (test_kernels.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxpar import kernels
from ctxpar.kernels import attention_kernels as attn_kernels
from ctxpar.layers.attention.backend import attention_lse, causal_attention, kernel_inputs
from helpers.attention_reference import reference

pytestmark = pytest.mark.skipif(
    not kernels.available() or not kernels.loaded().prefill_attention_bf16_supports(64, 64),
    reason="needs the compiled kernels on a CPU with AMX-BF16",
)
SETTINGS = settings(max_examples=20, deadline=None)
# A softmax weight rounded to bf16 is off by at most 2^-9 of itself, and the row sum
# adds the rounded weights: the output, a weighted mean of the values, moves by at most
# 2 * 2^-9 of the largest |value|, and the log-sum-exp by about 2^-9. Twice that, for the
# float32 steps around them.
WEIGHT_ROUNDING = 2.0**-9


def bf16(*shape: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g).bfloat16()


@settings(max_examples=25, deadline=None)
@given(
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 3, 4]),
    # (192, 128): MLA's expanded prefill (V narrower than Q and K)
    widths=st.sampled_from([(64, 64), (128, 128), (192, 128), (32, 32), (96, 64)]),
    chunk=st.integers(1, 150),
    context=st.sampled_from([0, 1, 63, 64, 65, 300]),
    seed=st.integers(0, 2**16),
)
def test_matches_reference_on_its_values(kv_heads, group, widths, chunk, context, seed) -> None:
    """A chunk of queries after `context` keys, as the layers pass them: views of
    a (S, 2, Hk, D) gather and of a fused projection."""
    g = torch.Generator().manual_seed(seed)
    (D, Dv), H, S = widths, kv_heads * group, context + chunk
    q = bf16(chunk, H + 2 * kv_heads, D, g=g)[:, :H]
    kv = bf16(S, 2, kv_heads, D, g=g)
    # A fresh tensor: .contiguous() of the slice keeps its strides when S = Hk = 1.
    k, v = kv[:, 0], torch.empty(S, kv_heads, Dv, dtype=torch.bfloat16).copy_(kv[:, 1, :, :Dv])
    assert attn_kernels.prefill_usable(q, k, v)
    out, lse = attn_kernels.prefill_attention(q, k, v, D**-0.5)
    want, want_lse = reference(q, k, v, D**-0.5)
    bound = 4 * WEIGHT_ROUNDING
    torch.testing.assert_close(out.double(), want, atol=bound * v.abs().max().item(), rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=bound, rtol=0)


@SETTINGS
@given(data=st.data())
def test_a_prompt_cut_anywhere(data: st.DataObject) -> None:
    """Chunked prefill, PCP's chunks, a prefix-cache hit's suffix: each chunk's queries
    over their causal prefix are the whole prompt's bits."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    kv_heads, group = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    D = data.draw(st.sampled_from([64, 128]))
    S = data.draw(st.integers(1, 300))
    L = data.draw(st.integers(1, S))
    q, k, v = bf16(L, kv_heads * group, D, g=g), bf16(S, kv_heads, D, g=g), bf16(S, kv_heads, D, g=g)
    whole, whole_lse = attn_kernels.prefill_attention(q, k, v, 0.125)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, L - 1)), max_size=4)))) if L > 1 else []
    bounds = [0, *[c for c in cuts if 0 < c < L], L]
    for a, b in zip(bounds, bounds[1:]):
        keys = S - L + b
        out, lse = attn_kernels.prefill_attention(q[a:b], k[:keys], v[:keys], 0.125)
        assert torch.equal(out, whole[a:b]) and torch.equal(lse, whole_lse[a:b])


@SETTINGS
@given(data=st.data())
def test_key_counts_alone_or_together(data: st.DataObject) -> None:
    """DCP's shards: a query over the first counts[i] keys is the same bits alone over
    just its keys, in any order and company (a key it does not see weighs exactly 0)."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    kv_heads, group = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    S, L = data.draw(st.integers(1, 300)), data.draw(st.integers(1, 80))
    counts = torch.tensor(data.draw(st.lists(st.integers(1, S), min_size=L, max_size=L)))
    q, kv = bf16(L, kv_heads * group, 64, g=g), bf16(S, 2, kv_heads, 64, g=g)
    whole, whole_lse = attn_kernels.prefill_attention(q, kv[:, 0], kv[:, 1], 0.125, counts=counts)
    for i in data.draw(st.lists(st.integers(0, L - 1), min_size=1, max_size=4)):
        n = int(counts[i])
        out, lse = attn_kernels.prefill_attention(q[i : i + 1], kv[:n, 0], kv[:n, 1], 0.125, counts=counts[i : i + 1])
        assert torch.equal(out[0], whole[i]) and torch.equal(lse[0], whole_lse[i]), i


def test_the_layers_take_the_tiles_for_bf16() -> None:
    """causal_attention and attention_lse send bf16 to the tiles as it is (not widened):
    the same bits as the kernel's own call; a width the tiles do not take (48) is padded
    with zeros to one they do, which changes no score (and values past the width are cut)."""
    g = torch.Generator().manual_seed(7)
    for D in (64, 48):
        q, kv = bf16(40, 9, D, g=g), bf16(90, 2, 3, D, g=g)
        direct = kernel_inputs(q, kv[:, 0], kv[:, 1])
        assert direct is not None and all(t.dtype == torch.bfloat16 for t in direct)
        assert [t.shape[-1] for t in direct] == [64, 64, 64]
        want, want_lse = attn_kernels.prefill_attention(*direct, 0.125)
        assert torch.equal(causal_attention(q, kv[:, 0], kv[:, 1], 0.125), want[..., :D].bfloat16())
        counts = torch.arange(51, 91)
        out, lse = attention_lse(q, kv[:, 0], kv[:, 1], 0.125, counts)
        assert torch.equal(out, want[..., :D]) and torch.equal(lse, want_lse)  # counts = the causal prefixes


def test_widths_the_tiles_do_not_take() -> None:
    """Q/K or V widths not a multiple of 32: not usable as they are."""
    q, kv = torch.zeros(4, 4, 64, dtype=torch.bfloat16), torch.zeros(8, 2, 2, 64, dtype=torch.bfloat16)
    assert attn_kernels.prefill_usable(q, kv[:, 0], kv[:, 1])
    assert not attn_kernels.prefill_usable(q[..., :48], kv[:, 0, :, :48], kv[:, 1, :, :48])
    assert not attn_kernels.prefill_usable(q, kv[:, 0], kv[:, 1, :, :48].contiguous())
    assert not attn_kernels.prefill_usable(q, kv[:, 0], kv[:, 1].float())  # one dtype
