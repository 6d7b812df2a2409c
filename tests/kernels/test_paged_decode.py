"""paged_decode.cpp's blocking over a GQA group: groups of 1-8 query heads (blocks of up
to 4 a pass over the keys, 2 in the AVX2 build), head widths that are whole vectors of
16 or an odd multiple of 8 (the 8-wide path), over float32 and int8 caches, against
float64 attention (helpers.attention_reference) over the same cache dequantized; and a
row's bits whatever rows share its call, with a soft cap and a sliding window."""

from __future__ import annotations

import pytest
import torch

from ctxpar.kernels import attention_kernels as attn_kernels
from ctxpar.layers.kv_quant import KVQuant, default_runs
from helpers.attention_reference import TOL, dequantize64, paged, reference

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
        want, want_lse = reference(q[b : b + 1], ctx[:, 0], ctx[:, 1], D**-0.5)
        torch.testing.assert_close(out[b].double(), want[0], **TOL)
        torch.testing.assert_close(lse[b].double(), want_lse[0], **TOL)


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
