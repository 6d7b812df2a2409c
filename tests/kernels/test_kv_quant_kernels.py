"""The attention kernels over a quantized KV cache (ctxpar/layers/kv_quant.py)
against float64 attention over the same cache dequantized (from its bytes, by
helpers.attention_reference.dequantize64): exact up to float32 rounding, for
every code type, GQA and MLA's latent rows in decode, causal and unmasked
prefill, native and AVX2 builds (prefill over int8 rows within the bound its
int16 codes allow, and the same bits on every build, thread count and chunking); and the
quantizer's and the heads' turn's kernels against their PyTorch paths, bit for bit, in
both builds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxpar import kernels
from ctxpar.kernels import attention_kernels as attn_kernels
from ctxpar.kernels import elementwise
from ctxpar.layers import kv_rotation
from ctxpar.layers.kv_quant import KVQuant, default_runs
from ctxpar.machine import cpu_info
from helpers.attention_reference import TOL, assert_within, dequantize64, int8_bounds, paged, reference
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
    head_dim=st.sampled_from([64, 256]),
    chunk=st.integers(1, 130),
    context=st.sampled_from([0, 1, 64, 200]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_prefill_over_quantized_rows(name, kv_heads, group, head_dim, chunk, context, causal, seed, march) -> None:
    """A chunk after `context` cached keys read from gathered quantized rows, as
    gqa_paged_attention passes them (q a view of a fused projection); causal or
    unmasked (DCP's shards): a query that sees every key is the last position.
    Over int8 rows both products are integer ones (the queries' and the weights' int16 codes): within
    int8_bounds; over fp8 rows exact up to float32 rounding."""
    g = torch.Generator().manual_seed(seed)
    Hk, H, D, L = kv_heads, kv_heads * group, head_dim, chunk
    S = context + L
    shape = (2, Hk, D)
    quant = KVQuant.of(name, shape, default_runs(shape))
    rows, kv = quantized_cache(quant, S, g)
    q = torch.randn(L, H + 2 * Hk, D, generator=g)[:, :H]
    assert attn_kernels.prefill_quant_usable(q, quant)
    out, lse = attn_kernels.prefill_attention_quant(q, rows, quant, D**-0.5, causal)
    seen = None if causal else torch.ones(L, S, dtype=torch.bool)
    bound, lse_bound = int8_bounds(q, kv[:, 0], kv[:, 1], D**-0.5, seen) if name == "int8" else (0.0, 0.0)
    for i in range(L) if not causal else [None]:
        rows_of = slice(None) if i is None else slice(i, i + 1)
        want, want_lse = reference(q[rows_of], kv[:, 0], kv[:, 1], D**-0.5)
        at = (lambda b: b) if name != "int8" else (lambda b: b[rows_of])
        assert_within(out[rows_of], want, at(bound))
        assert_within(lse[rows_of], want_lse, at(lse_bound))


def int8_case(L: int, S: int, kv_heads: int, group: int, D: int, seed: int):
    """Queries (L, H, D), S int8 rows of (2, kv_heads, D) entries, their KVQuant."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, kv_heads, D)
    quant = KVQuant.of("int8", shape, default_runs(shape))
    x = torch.randn(S, *shape, generator=g) * torch.exp(0.5 * torch.randn(S, *shape, generator=g))
    q = torch.randn(L, kv_heads * group, D, generator=g) * torch.exp(torch.randn(L, kv_heads * group, 1, generator=g))
    return q, quant.quantize(x), quant


def test_int8_prefill_over_32_wide_heads(monkeypatch) -> None:
    """32-wide heads (Qwen3's small models') are whole tiles of the AVX2 build's 4 vectors of
    8, which takes them (AVX-512's tiles are 64 wide and leave them to PyTorch): its int8
    prefill over them, a causal chunk after cached keys, within int8_bounds of float64."""
    lib = kernels._library("haswell")
    assert lib is not None and lib.prefill_attention_supports(32, 32)
    monkeypatch.setattr(kernels, "_library", lambda march="native": lib)
    L, S, D = 70, 134, 32
    q, rows, quant = int8_case(L, S, 2, 3, D, seed=7)
    assert attn_kernels.prefill_quant_usable(q, quant)
    out, lse = attn_kernels.prefill_attention_quant(q, rows, quant, D**-0.5)
    kv = dequantize64(rows, quant.codes, quant.runs).view(S, *quant.entry_shape)
    bound, lse_bound = int8_bounds(q, kv[:, 0], kv[:, 1], D**-0.5, None)
    want, want_lse = reference(q, kv[:, 0], kv[:, 1], D**-0.5)
    assert_within(out, want, bound)
    assert_within(lse, want_lse, lse_bound)


def test_int8_prefill_gives_the_same_bits_on_every_build_thread_count_and_chunking(monkeypatch) -> None:
    """int8 keys' scores are integer sums, which AVX-512 VNNI (native), AVX-VNNI (alderlake)
    and AVX2's madd (haswell) find alike, and the softmax sums keys in the same order on
    every vector width: one prompt's outputs are the same bits on each build, with one
    thread or two, whole or cut into causal chunks (each over the keys up to its end)."""
    L, S = 150, 200
    q, rows, quant = int8_case(L, S, 2, 3, 64, seed=5)
    builds = ["native", "haswell", *(["alderlake"] if "avx_vnni" in cpu_info().flags else [])]
    threads = torch.get_num_threads()
    results = []
    for march in builds:
        lib = kernels._library(march)
        assert lib is not None
        monkeypatch.setattr(kernels, "_library", lambda march="native", lib=lib: lib)
        for n in sorted({1, 2, threads}):
            torch.set_num_threads(n)
            try:
                results.append(attn_kernels.prefill_attention_quant(q, rows, quant, 0.125))
            finally:
                torch.set_num_threads(threads)
        cuts = [0, 1, 64, 97, L]
        parts = [
            attn_kernels.prefill_attention_quant(q[a:b], rows[: S - L + b], quant, 0.125)
            for a, b in zip(cuts, cuts[1:])
        ]
        results.append((torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])))
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


@pytest.mark.parametrize("D", [512, 576])  # the widest integer sums, and past them (dequantized to floats)
def test_int8_prefill_at_the_int32_sums_edge(D, march) -> None:
    """Key 0's codes all -128 against a query of -1s (codes -32767): at 512 dims the sum is
    512 · 32767 · 128, just under 2^31, with every product pair at its largest; it must
    neither wrap nor saturate (key 0 dominates the softmax). Wider heads leave the
    integer path: within float32 rounding there."""
    q, rows, quant = int8_case(3, 40, 1, 2, D, seed=D)
    q[0] = -1.0
    rows[0, :D] = torch.tensor(-128, dtype=torch.int8).view(torch.uint8)
    kv = dequantize64(rows, quant.codes, quant.runs).view(40, *quant.entry_shape)
    out, lse = attn_kernels.prefill_attention_quant(q, rows, quant, D**-0.5)
    want, want_lse = reference(q, kv[:, 0], kv[:, 1], D**-0.5)
    bound, lse_bound = int8_bounds(q, kv[:, 0], kv[:, 1], D**-0.5) if D <= 512 else (0.0, 0.0)
    assert_within(out, want, bound)
    assert_within(lse, want_lse, lse_bound)


def test_int8_prefill_queries_of_zeros_and_of_nan(march) -> None:
    """A query of zeros (scale 0) weighs its keys alike: the mean of the values it sees. One
    with a NaN or an infinity gets NaN, and the queries beside it the bits they get without it."""
    L, S = 20, 30
    q, rows, quant = int8_case(L, S, 1, 2, 64, seed=3)
    q[4, 0] = 0.0
    kv = dequantize64(rows, quant.codes, quant.runs).view(S, *quant.entry_shape)
    clean, clean_lse = attn_kernels.prefill_attention_quant(q, rows, quant, 0.125)
    k, v = kv[: S - L + 5, 0], kv[: S - L + 5, 1]
    want, want_lse = reference(q[4:5], k, v, 0.125)
    bound, lse_bound = int8_bounds(q[4:5], k, v, 0.125)
    assert lse_bound[0, 0].item() == 0.0  # its scores are exact: all 0
    assert_within(clean[4:5], want, bound)
    assert_within(clean_lse[4:5], want_lse, lse_bound)
    assert_within(clean[4, 0], kv[: S - L + 5, 1, 0].mean(0), bound[0, 0])
    q[7, 1, 5], q[9, 0] = float("inf"), 0.0
    q[9, 0, 3] = float("nan")  # a query of zeros but a NaN: NaN too, not a query of zeros
    out, lse = attn_kernels.prefill_attention_quant(q, rows, quant, 0.125)
    assert out[7, 1].isnan().all() and lse[7, 1].isnan() and out[9, 0].isnan().all() and lse[9, 0].isnan()
    others = torch.ones(L, 2, dtype=torch.bool)
    others[7, 1] = others[9, 0] = False
    assert torch.equal(out[others], clean[others]) and torch.equal(lse[others], clean_lse[others])


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
