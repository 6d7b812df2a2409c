"""Sliding-window attention and soft-capped logits (``AttentionSpec.window``, ``.soft_cap``) in
every attention kernel (prefill over float32 entries and over int8 cache rows, DCP's partials
with a first key per query, decode over float32, bf16 and int8 paged caches) and in the PyTorch
ops, against a plain masked softmax written here in float64: a query at position p sees the keys
at positions (p - window, p] (transformers' sliding_window_overlay), its scaled logits x become
cap · tanh(x / cap) (Gemma 2). Windows of one key, smaller than a kernel's block, spanning
blocks and longer than the context. And the kernels' guarantee: a query's bits do not depend on
the queries beside it (how a prompt is chunked, which rows share a decode call).
"""

from __future__ import annotations

import pytest
import torch

from ctxpar import kernels
from ctxpar.layers.attention.backend import KERNELS, TORCH, AttentionBackend, AttentionSpec, DecodeGroup
from ctxpar.layers.attention.torch_ops import concat_slots
from ctxpar.layers.kv_quant import KVQuant, default_runs
from helpers.attention_reference import assert_within, int8_bounds
from helpers.int8_scores import query_rounding_bounds

H, HK, D = 4, 2, 32
SCALE = D**-0.5
WINDOWS = [None, 1, 5, 70, 1000]  # none, one key, under a block (64), over one, past the context
CAPS = [None, 1.5]  # a cap the logits here (spread over several units) feel
BACKENDS = [
    pytest.param(KERNELS, id="kernels", marks=pytest.mark.skipif(not kernels.available(), reason="no kernels")),
    pytest.param(TORCH, id="torch"),
]
TOL = dict(atol=2e-5, rtol=2e-5)


def masked_softmax(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor, cap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (L, H, D) over k, v (S, Hk, D), query i over the keys seen[i] (L, S) bool, in float64
    -> out (L, H, D) (0 for a query that sees none), lse (L, H) (-inf there)."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("lhd,shd->hls", q.double(), kk) * SCALE
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, -1)  # (H, L)
    p = torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None])
    return torch.einsum("hls,shd->lhd", p, vv), lse.T


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """(L, S): key s at k_pos[s] is seen by query i at q_pos[i]: causal, and within the window."""
    seen = k_pos[None, :] <= q_pos[:, None]
    return seen if window is None else seen & (k_pos[None, :] > q_pos[:, None] - window)


def qkv(L: int, S: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, H, D, generator=g) * 3, torch.randn(S, HK, D, generator=g), torch.randn(S, HK, D, generator=g)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cap", CAPS)
def test_prefill_is_the_masked_softmax(backend: AttentionBackend, window: int | None, cap: float | None) -> None:
    """60 queries after 90 keys of context (S = 150: three key blocks)."""
    L, S = 60, 150
    q, k, v = qkv(L, S)
    out = backend.prefill(q, k, v, AttentionSpec(SCALE, window, cap))
    want, _ = masked_softmax(q, k, v, window_mask(torch.arange(S - L, S), torch.arange(S), window), cap)
    torch.testing.assert_close(out.double(), want, **TOL)


@pytest.mark.skipif(not kernels.available(), reason="no kernels")
@pytest.mark.parametrize("window", [5, 70])
@pytest.mark.parametrize("cap", CAPS)
def test_a_prompts_bits_do_not_depend_on_its_chunks(window: int, cap: float | None) -> None:
    S = 200
    q, k, v = qkv(S, S)
    spec = AttentionSpec(SCALE, window, cap)
    whole = KERNELS.prefill(q, k, v, spec)
    for cuts in ([0, 1, 2, 67, 130, 200], [0, 100, 101, 200]):
        for a, b in zip(cuts, cuts[1:]):
            assert torch.equal(KERNELS.prefill(q[a:b], k[:b], v[:b], spec), whole[a:b]), (cuts, a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cap", CAPS)
def test_partials_see_their_key_ranges(backend: AttentionBackend, cap: float | None) -> None:
    """DCP's partials: query i over keys [firsts[i], counts[i]) of a shard, some ranges empty
    (a shard holding no key of a query's window): out 0, lse -inf."""
    m = 140
    q, k, v = qkv(6, m)
    counts = torch.tensor([1, 9, 64, 65, 100, 140])
    firsts = torch.tensor([0, 9, 3, 65, 30, 139])  # the second and the fourth see nothing
    out, lse = backend.partial(q, k, v, AttentionSpec(SCALE, 4, cap), counts, firsts)
    keys = torch.arange(m)
    seen = (keys[None, :] >= firsts[:, None]) & (keys[None, :] < counts[:, None])
    want, want_lse = masked_softmax(q, k, v, seen, cap)
    torch.testing.assert_close(out.double(), want, **TOL)
    torch.testing.assert_close(lse.double(), want_lse, **TOL)
    assert (lse[[1, 3]] == float("-inf")).all() and (out[[1, 3]] == 0).all()
    with pytest.raises(ValueError, match="needs each query's first key"):
        backend.partial(q, k, v, AttentionSpec(SCALE, 4, cap), counts)


@pytest.mark.skipif(not kernels.available(), reason="no kernels")
@pytest.mark.parametrize("window", [1, 5, 70])
@pytest.mark.parametrize("cap", CAPS)
def test_int8_cache_rows_are_read_with_the_window(window: int, cap: float | None) -> None:
    """The prefill kernel over int8 rows, read in place: the masked softmax of the rows
    dequantized, within the rounding of its integer products (int8_bounds; a soft cap's
    tanh moves no score by more than its argument moved). Where the CPU's kernel does not
    take these heads (AVX-512's tiles of 64 values) PyTorch's path answers, exactly."""
    L, S = 60, 150
    q, k, v = qkv(L, S)
    quant = KVQuant.of("int8", (2, HK, D), default_runs((2, HK, D)))
    assert quant is not None
    rows = quant.quantize(torch.stack([k, v], 1))
    kv = quant.dequantize(rows)
    spec = AttentionSpec(SCALE, window, cap)
    out = KERNELS.gqa_prefill_rows(q, rows, quant, spec, torch.empty(L, H, D))
    causal = window_mask(torch.arange(S - L, S), torch.arange(S), window)
    want, _ = masked_softmax(q, kv[:, 0], kv[:, 1], causal, cap)
    assert_within(out, want, int8_bounds(q, kv[:, 0], kv[:, 1], SCALE, causal)[0])
    counts, firsts = torch.full((L,), S), torch.arange(L) * 2
    part, _ = KERNELS.gqa_partial_rows(q, rows, quant, spec, counts, firsts)
    seen = (torch.arange(S)[None, :] >= firsts[:, None]) & (torch.arange(S)[None, :] < counts[:, None])
    want, _ = masked_softmax(q, kv[:, 0], kv[:, 1], seen, cap)
    assert_within(part, want, int8_bounds(q, kv[:, 0], kv[:, 1], SCALE, seen)[0])


LENGTHS = [1, 7, 64, 150, 300]  # one key, a few, a run, several runs (the kernel cuts rows of 256)


def paged(cache_dtype: str, num_slots: int, seed: int = 1) -> tuple[torch.Tensor, KVQuant | None, torch.Tensor]:
    """A paged cache of random entries: (the cache as stored, its quantization, its entries as
    float32 (num_slots, 2, Hk, D), what attention reads)."""
    entries = torch.randn(num_slots, 2, HK, D, generator=torch.Generator().manual_seed(seed))
    if cache_dtype == "int8":
        quant = KVQuant.of("int8", (2, HK, D), default_runs((2, HK, D)))
        assert quant is not None
        rows = quant.quantize(entries)
        return rows, quant, quant.dequantize(rows)
    cache = entries.to(getattr(torch, cache_dtype))
    return cache, None, cache.float()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cap", CAPS)
def test_decode_rows_see_their_last_window_keys(
    backend: AttentionBackend, cache_dtype: str, window: int | None, cap: float | None
) -> None:
    """One query per row over its slots (scattered over the cache), the query's own last; each
    row's bits the same alone as in the batch."""
    cache, quant, entries = paged(cache_dtype, sum(LENGTHS) + 5)
    perm = torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(2))
    rows = [perm[sum(LENGTHS[:b]) : sum(LENGTHS[: b + 1])] for b in range(len(LENGTHS))]
    q = torch.randn(len(LENGTHS), H, D, generator=torch.Generator().manual_seed(3)) * 3
    spec = AttentionSpec(SCALE, window, cap)
    out, lse = backend.gqa_decode(q, cache, DecodeGroup(torch.arange(len(rows)), *concat_slots(rows)), spec, quant)
    for b, slots in enumerate(rows):
        n = len(slots)
        seen = window_mask(torch.tensor([n - 1]), torch.arange(n), window)
        want, want_lse = masked_softmax(q[b : b + 1], entries[slots, 0], entries[slots, 1], seen, cap)
        out_tol, lse_tol = TOL, TOL
        if backend is KERNELS and quant is not None:  # the kernel's scores use q rounded to int16
            out_err, lse_err = (float(x.max()) for x in query_rounding_bounds(q[b], *entries[slots].unbind(1), SCALE))
            out_tol, lse_tol = dict(TOL, atol=2e-5 + out_err), dict(TOL, atol=2e-5 + lse_err)
        torch.testing.assert_close(out[b : b + 1].double(), want, **out_tol)
        torch.testing.assert_close(lse[b : b + 1].double(), want_lse, **lse_tol)
        if backend is KERNELS:
            alone = backend.gqa_decode(
                q[b : b + 1], cache, DecodeGroup(torch.arange(1), *concat_slots([slots])), spec, quant
            )
            assert torch.equal(alone[0], out[b : b + 1]) and torch.equal(alone[1], lse[b : b + 1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_windowed_prompt_over_the_paged_cache_reads_whole_runs_of_keys(backend: AttentionBackend) -> None:
    """A prompt's chunks over the paged cache read their keys from the run of KEY_BLOCK_ALIGN that
    holds their first query's window (layers/attention/paged.py's window_keys): any chunking gives
    the masked softmax, and in the kernels the bits of the whole prompt at once."""
    from ctxpar.layers.attention.paged import gqa_paged_attention
    from helpers.reference import single_sequence_context

    S, window = 300, 5
    q, k, v = qkv(S, S)
    cache = torch.stack([k, v], 1)  # (S, 2, Hk, D): slot = position
    spec = AttentionSpec(SCALE, window, 1.5)
    outs = []
    for cuts in ([0, 300], [0, 200, 300], [0, 150, 151, 300], [0, 260, 300]):
        chunks = []
        for a, b in zip(cuts, cuts[1:]):
            ctx = single_sequence_context([cache], a, b - a)
            ctx.backend = backend
            chunks.append(gqa_paged_attention(q[a:b], cache, ctx, spec))
        outs.append(torch.cat(chunks))
    want, _ = masked_softmax(q, k, v, window_mask(torch.arange(S), torch.arange(S), window), 1.5)
    torch.testing.assert_close(outs[0].double(), want, **TOL)
    if backend is KERNELS:
        assert all(torch.equal(out, outs[0]) for out in outs[1:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_rows_without_keys_weigh_nothing(backend: AttentionBackend) -> None:
    """A DCP shard may hold no key of a row's window (dcp_metadata.py cuts it to none): out 0,
    lse -inf, with other rows or alone."""
    cache, _, entries = paged("float32", 16)
    q = torch.randn(2, H, D)
    spec = AttentionSpec(SCALE, 4)
    out, lse = backend.gqa_decode(
        q, cache, DecodeGroup(torch.arange(2), *concat_slots([torch.arange(0), torch.arange(3)])), spec, None
    )
    want, want_lse = masked_softmax(q[1:], entries[:3, 0], entries[:3, 1], torch.ones(1, 3, dtype=torch.bool), None)
    torch.testing.assert_close(out[1:].double(), want, **TOL)
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()
    empty = DecodeGroup(torch.arange(1), torch.zeros(0, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    out, lse = backend.gqa_decode(q[:1], cache, empty, spec, None)
    assert (out == 0).all() and (lse == float("-inf")).all()
