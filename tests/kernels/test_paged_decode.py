"""paged_decode.cpp's blocking over a GQA group: groups of 1-8 query heads (blocks of up
to 4 a pass over the keys, 2 in the AVX2 build), head widths that are whole vectors of
16 or an odd multiple of 8 (the 8-wide path), over float32 and int8 caches, against
float64 attention (helpers.attention_reference) over the same cache dequantized; and a
row's bits whatever rows share its call, with a soft cap and a sliding window.

Over an int8 cache the scores are integer dot products of the keys' codes with q
quantized to int16 (paged_decode.cpp's quantize_query): checked against float64 with q
rounded by the same rule, and against exact q within the bound that rounding leaves;
their bits are the same in every build (AVX-512 VNNI, AVX-VNNI, AVX2)."""

from __future__ import annotations

import pytest
import torch

from ctxpar import kernels
from ctxpar.kernels import attention_kernels as attn_kernels
from ctxpar.layers.kv_quant import KVQuant, default_runs
from ctxpar.machine import cpu_info
from helpers.attention_reference import TOL, dequantize64, paged, reference
from helpers.int8_scores import check_int8_row

LENGTHS = [1, 15, 17, 300, 700]  # under a block of 16 keys, between, and several tasks


@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("head_dim", [24, 64])
@pytest.mark.parametrize("kv_dtype", ["model", "int8"])
def test_gqa_groups_and_widths_match_float64(group: int, head_dim: int, kv_dtype: str, march: str) -> None:
    g = torch.Generator().manual_seed(group * 1000 + head_dim)
    Hk, D = 2, head_dim
    slots, starts, num_slots = paged(LENGTHS, 16, g)
    entries = torch.randn(num_slots, 2, Hk, D, generator=g)
    quant = KVQuant.of(kv_dtype, (2, Hk, D), default_runs((2, Hk, D)))
    if quant is None:
        cache, kv = entries, entries.double()
    else:
        cache = quant.quantize(entries)
        kv = dequantize64(cache, quant.codes, quant.runs).view(num_slots, 2, Hk, D)
    q = torch.randn(len(LENGTHS), Hk * group, D, generator=g)
    out, lse = attn_kernels.gqa_paged_decode(q, cache, slots, starts, D**-0.5, quant)
    for b in range(len(LENGTHS)):
        ctx = kv[slots[starts[b] : starts[b + 1]]]
        if quant is not None:
            check_int8_row((out[b], lse[b]), q[b], ctx[:, 0], ctx[:, 1], D**-0.5)
            continue
        want, want_lse = reference(q[b : b + 1], ctx[:, 0], ctx[:, 1], D**-0.5)
        torch.testing.assert_close(out[b].double(), want[0], **TOL)
        torch.testing.assert_close(lse[b].double(), want_lse[0], **TOL)


def test_int8_extremes_and_degenerate_queries(march: str) -> None:
    """Head width 256 with every code at its extreme (q's 32767, the keys' +-127: the int32
    sums' largest), a head of zeros (every score 0: the values' mean), and a NaN or
    infinite query value, which makes its own head's out NaN and no other head's."""
    Hk, D, S = 2, 256, 40
    quant = KVQuant.of("int8", (2, Hk, D), default_runs((2, Hk, D)))
    assert quant is not None
    g = torch.Generator().manual_seed(7)
    signs = torch.where(torch.rand(S, 1, Hk, 1, generator=g) < 0.5, -1.0, 1.0)
    keys = signs * torch.ones(S, 1, Hk, D) * (1 + torch.rand(S, 1, Hk, 1, generator=g))
    cache = quant.quantize(torch.cat([keys, torch.randn(S, 1, Hk, D, generator=g)], 1))
    kv = dequantize64(cache, quant.codes, quant.runs).view(S, 2, Hk, D)
    slots, starts = torch.randperm(S, generator=g), torch.tensor([0, S])
    q = torch.full((1, 2 * Hk, D), 0.02)  # every code 32767, the scores near the softmax's limits
    q[0, 1] = 0.0
    got = attn_kernels.gqa_paged_decode(q, cache, slots, starts, 1.0, quant)
    ctx = kv[slots]
    check_int8_row((got[0][0], got[1][0]), q[0], ctx[:, 0], ctx[:, 1], 1.0)
    torch.testing.assert_close(got[0][0, 1].double(), ctx[:, 1, 0].mean(0), **TOL)
    for bad in (float("nan"), float("inf")):
        q[0, 2, 5] = bad
        out, lse = attn_kernels.gqa_paged_decode(q, cache, slots, starts, 1.0, quant)
        assert out[0, 2].isnan().all() and lse[0, 2].isnan()
        assert torch.equal(out[0, [0, 1, 3]], got[0][0, [0, 1, 3]])


@pytest.mark.skipif("avx_vnni" not in cpu_info().flags, reason="this CPU cannot run an AVX-VNNI build")
@pytest.mark.skipif("avx512_vnni" not in cpu_info().flags, reason="this CPU cannot run an AVX-512 VNNI build")
@pytest.mark.parametrize("head_dim", [24, 64, 128])
def test_int8_bits_are_the_same_in_every_build(head_dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """AVX-512 VNNI's vpdpwssd on 16-lane vectors (native), AVX-VNNI's on 8 (alderlake) and
    AVX2's vpmaddwd + vpaddd (haswell) sum the same integers, and the softmax around them
    adds in the same order in every build: one row's out and lse, the same bits."""
    g = torch.Generator().manual_seed(head_dim)
    Hk, D = 2, head_dim
    slots, starts, num_slots = paged(LENGTHS, 16, g)
    quant = KVQuant.of("int8", (2, Hk, D), default_runs((2, Hk, D)))
    assert quant is not None
    cache = quant.quantize(torch.randn(num_slots, 2, Hk, D, generator=g) * 3)
    q = torch.randn(len(LENGTHS), Hk * 4, D, generator=g) * 3
    libs = {march: kernels._library(march) for march in ("native", "alderlake", "haswell")}
    assert len({lib._name for lib in libs.values() if lib is not None}) == 3
    got = {}
    for march, lib in libs.items():
        monkeypatch.setattr(kernels, "_library", lambda march="native", lib=lib: lib)
        got[march] = [
            attn_kernels.gqa_paged_decode(q, cache, slots, starts, D**-0.5, quant, window, cap)
            for window, cap in [(None, None), (100, 5.0)]
        ]
    for march in ("alderlake", "haswell"):
        for (out, lse), (want, want_lse) in zip(got[march], got["native"], strict=True):
            assert torch.equal(out, want) and torch.equal(lse, want_lse), march


@pytest.mark.parametrize("group", [3, 4])
def test_rows_alone_or_together_with_cap_and_window(group: int, march: str) -> None:
    g = torch.Generator().manual_seed(group)
    Hk, D = 2, 64
    slots, starts, num_slots = paged(LENGTHS, 16, g)
    quant = KVQuant.of("int8", (2, Hk, D), default_runs((2, Hk, D)))
    assert quant is not None
    cache = quant.quantize(torch.randn(num_slots, 2, Hk, D, generator=g) * 3)
    q = torch.randn(len(LENGTHS), Hk * group, D, generator=g) * 3
    for window, cap in [(None, 5.0), (100, None), (33, 2.0)]:
        out, lse = attn_kernels.gqa_paged_decode(q, cache, slots, starts, D**-0.5, quant, window, cap)
        for b in range(len(LENGTHS)):
            one = torch.tensor([0, int(starts[b + 1] - starts[b])], dtype=torch.int64)
            alone, alone_lse = attn_kernels.gqa_paged_decode(
                q[b : b + 1], cache, slots[starts[b] : starts[b + 1]], one, D**-0.5, quant, window, cap
            )
            assert torch.equal(alone[0], out[b]) and torch.equal(alone_lse[0], lse[b]), (b, window, cap)
