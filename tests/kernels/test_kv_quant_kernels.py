"""The attention kernels over a quantized KV cache (ctxpar/layers/kv_quant.py)
against float64 attention over the same cache dequantized (from its bytes, by
helpers.attention_reference.dequantize64): exact up to float32 rounding, for
every code type, GQA and MLA's latent rows in decode, causal and unmasked
prefill, native and AVX2 builds; and the quantizer's and the heads' turn's kernels
against their PyTorch paths, bit for bit, in both builds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxpar.kernels import attention_kernels as attn_kernels
from ctxpar.kernels import elementwise
from ctxpar.layers import kv_rotation
from ctxpar.layers.kv_quant import KVQuant, default_runs
from helpers.attention_reference import TOL, dequantize64, paged, reference
from helpers.int8_scores import check_int8_row

NAMES = st.sampled_from(["int8", "fp8_e4m3", "fp8_e5m2"])
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def quantized_cache(quant: KVQuant, num_slots: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of random entries (of uneven magnitudes, so that runs' scales differ) and
    their float64 dequantization (num_slots, *E)."""
    x = torch.randn(num_slots, *quant.entry_shape, generator=g)
    x *= torch.exp(0.5 * torch.randn(num_slots, *quant.entry_shape, generator=g))
    rows = quant.quantize(x)
    return rows, dequantize64(rows, quant.codes, quant.runs).view(num_slots, *quant.entry_shape)


@settings(max_examples=12, **SETTINGS)
@given(
    name=NAMES,
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 3]),
    head_dim=st.sampled_from([8, 64]),
    lengths=st.lists(st.integers(0, 600), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_gqa_decode_over_quantized_rows(name, kv_heads, group, head_dim, lengths, seed, march) -> None:
    g = torch.Generator().manual_seed(seed)
    Hk, H, D = kv_heads, kv_heads * group, head_dim
    shape = (2, Hk, D)
    quant = KVQuant.of(name, shape, default_runs(shape))
    slots, starts, num_slots = paged(lengths, 16, g)
    rows, kv = quantized_cache(quant, num_slots, g)
    q = torch.randn(len(lengths), H, D, generator=g)
    assert attn_kernels.usable(rows, D)
    out, lse = attn_kernels.gqa_paged_decode(q, rows, slots, starts, D**-0.5, quant)
    for b, n in enumerate(lengths):
        if n == 0:
            assert (out[b] == 0).all() and torch.isneginf(lse[b]).all()
            continue
        ctx = kv[slots[starts[b] : starts[b + 1]]]
        if name == "int8":  # integer scores: q rounded to int16 (helpers/int8_scores.py)
            check_int8_row((out[b], lse[b]), q[b], ctx[:, 0], ctx[:, 1], D**-0.5)
            continue
        want, want_lse = reference(q[b : b + 1], ctx[:, 0], ctx[:, 1], D**-0.5)
        torch.testing.assert_close(out[b].double(), want[0], **TOL)
        torch.testing.assert_close(lse[b].double(), want_lse[0], **TOL)


@settings(max_examples=8, **SETTINGS)
@given(
    name=NAMES,
    heads=st.sampled_from([1, 4]),
    widths=st.sampled_from([(40, 32), (576, 512)]),
    lengths=st.lists(st.integers(1, 400), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_mla_latent_decode_over_quantized_rows(name, heads, widths, lengths, seed, march) -> None:
    """The latent and the rope key have a scale each: the key's score takes both,
    the value (the latent) only the first."""
    g = torch.Generator().manual_seed(seed)
    E, r = widths
    quant = KVQuant.of(name, (E,), (r, E - r))
    slots, starts, num_slots = paged(lengths, 16, g)
    rows, kv = quantized_cache(quant, num_slots, g)
    q = torch.randn(len(lengths), heads, E, generator=g)
    out, lse = attn_kernels.latent_paged_decode(q, rows, slots, starts, r, 0.1, quant)
    for b in range(len(lengths)):
        k = kv[slots[starts[b] : starts[b + 1]]][:, None]  # (S, 1, E)
        want, want_lse = reference(q[b : b + 1], k, k[..., :r], 0.1)
        torch.testing.assert_close(out[b].double(), want[0], **TOL)
        torch.testing.assert_close(lse[b].double(), want_lse[0], **TOL)


@settings(max_examples=10, **SETTINGS)
@given(
    name=NAMES,
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 3]),
    chunk=st.integers(1, 130),
    context=st.sampled_from([0, 1, 64, 200]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_prefill_over_quantized_rows(name, kv_heads, group, chunk, context, causal, seed, march) -> None:
    """A chunk after `context` cached keys read from gathered quantized rows, as
    gqa_paged_attention passes them (q a view of a fused projection); causal or
    unmasked (DCP's shards): a query that sees every key is the last position."""
    g = torch.Generator().manual_seed(seed)
    Hk, H, D, L = kv_heads, kv_heads * group, 64, chunk
    S = context + L
    shape = (2, Hk, D)
    quant = KVQuant.of(name, shape, default_runs(shape))
    rows, kv = quantized_cache(quant, S, g)
    q = torch.randn(L, H + 2 * Hk, D, generator=g)[:, :H]
    assert attn_kernels.prefill_quant_usable(q, quant)
    out, lse = attn_kernels.prefill_attention_quant(q, rows, quant, D**-0.5, causal)
    for i in range(L) if not causal else [None]:
        qi, keys = (q, S) if i is None else (q[i : i + 1], S)
        want, want_lse = reference(qi, kv[:keys, 0], kv[:keys, 1], D**-0.5)
        got, got_lse = (out, lse) if i is None else (out[i : i + 1], lse[i : i + 1])
        torch.testing.assert_close(got.double(), want, **TOL)
        torch.testing.assert_close(got_lse.double(), want_lse, **TOL)


@pytest.mark.parametrize("runs", [(64,) * 6, (512, 64), (24, 8, 3)])  # whole vectors, MLA's, and tails
def test_int8_quantizer_writes_pytorchs_bytes(runs, march) -> None:
    """kv_quantize's int8 vectors round as PyTorch does (ties to even, the clamp at
    +-127), codes and scales, in runs of whole vectors and with a tail of single lanes."""
    quant = KVQuant.of("int8", (sum(runs),), runs)
    g = torch.Generator().manual_seed(len(runs))
    x = torch.randn(33, sum(runs), generator=g) * torch.exp(2 * torch.randn(33, sum(runs), generator=g))
    x[1] = 0.0  # a token of zeros: scale 0
    x[2, :5] = torch.tensor([127.0, 2.5, -0.5, -3.5, 126.5]) * x[2, : runs[0]].abs().max() / 127  # ties
    assert torch.equal(quant.quantize(x), quant.quantize_torch(x))


@pytest.mark.parametrize("dim", [2, 8, 16, 32, 64, 128, 256])  # under, one to 16 (AVX2: 32) vectors
def test_turn_kernel_gives_the_pytorch_paths_bits(dim, march) -> None:
    """hadamard_f32's in-register runs (heads of whole vectors) and its tiles (narrower
    heads, and wider ones) compute each value as kv_rotation's PyTorch path does."""
    x = torch.randn(7, 5, dim, generator=torch.Generator().manual_seed(dim))
    got = x.clone()
    elementwise.hadamard_(got, 0.125)
    assert torch.equal(got, kv_rotation._turn_torch(x.view(-1, dim).clone(), 0.125).view(x.shape))
