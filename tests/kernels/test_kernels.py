"""The compiled CPU kernels (ctxpar/kernels) against the straightforward path:
explicit scores, an explicit bottom-right causal mask and a softmax per row in
float64 (fp32 tolerance 1e-5).

- decode: random shapes, GQA ratios, MLA's shared latent key, context lengths
  that span several of the kernel's key runs, paged slot layouts, empty rows;
- prefill: random chunk and context lengths (ragged last blocks, chunks after
  a long context), GQA ratios, head widths, strided views as the layers pass;
- how they are built, found and turned off."""

from __future__ import annotations

import re
import tempfile
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxpar import kernels
from ctxpar.kernels import attention_kernels as attn_kernels
from helpers.attention_reference import TOL, paged, reference


def test_kernel_builds_here() -> None:
    """This machine (and CI's) has g++: the kernel must build, or every other
    test here would only check the PyTorch path."""
    assert attn_kernels.usable(torch.zeros(4, 2, 1, 8), 8)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3, 4, 7]),
    head_dim=st.sampled_from([8, 16, 24, 64, 72]),
    lengths=st.lists(st.integers(0, 700), min_size=1, max_size=5),
    block_size=st.sampled_from([1, 5, 16]),
    seed=st.integers(0, 2**16),
)
def test_gqa_rows_match_reference(kv_heads, group, head_dim, lengths, block_size, seed, march) -> None:
    g = torch.Generator().manual_seed(seed)
    Hk, H, D = kv_heads, kv_heads * group, head_dim
    slots, starts, num_slots = paged(lengths, block_size, g)
    cache = torch.randn(num_slots, 2, Hk, D, generator=g)
    q = torch.randn(len(lengths), H, D, generator=g)
    out, lse = attn_kernels.paged_decode(q, cache, slots, starts, Hk, D, (2 * Hk * D, D, Hk * D), D**-0.5)
    for b, n in enumerate(lengths):
        if n == 0:  # no keys (an empty DCP shard): out 0 and lse -inf, so a merge ignores it
            assert (out[b] == 0).all() and torch.isneginf(lse[b]).all()
            continue
        kv = cache[slots[starts[b] : starts[b + 1]]]
        want, want_lse = reference(q[b : b + 1], kv[:, 0], kv[:, 1], D**-0.5)
        torch.testing.assert_close(out[b].double(), want[0], **TOL)
        torch.testing.assert_close(lse[b].double(), want_lse[0], **TOL)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    heads=st.sampled_from([1, 4, 16]),
    widths=st.sampled_from([(40, 32), (16, 8), (576, 512)]),
    lengths=st.lists(st.integers(1, 600), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_mla_latent_rows_match_reference(heads, widths, lengths, seed, march) -> None:
    """MLA's absorbed decode: one latent per slot is the key of every head, and
    its first value_dim entries are the value."""
    g = torch.Generator().manual_seed(seed)
    E, r = widths
    slots, starts, num_slots = paged(lengths, 16, g)
    cache = torch.randn(num_slots, E, generator=g)
    q = torch.randn(len(lengths), heads, E, generator=g)
    out, lse = attn_kernels.paged_decode(q, cache, slots, starts, 1, r, (E, 0, 0), 0.1)
    for b in range(len(lengths)):
        k = cache[slots[starts[b] : starts[b + 1]]][:, None]  # (S, 1, E)
        want, want_lse = reference(q[b : b + 1], k, k[..., :r], 0.1)
        torch.testing.assert_close(out[b].double(), want[0], **TOL)
        torch.testing.assert_close(lse[b].double(), want_lse[0], **TOL)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 3, 4]),
    head_dim=st.sampled_from([64, 128, 192]),  # 192: MLA's expanded prefill (nope 128 + rope 64)
    narrow_values=st.booleans(),  # V 64 wide (MLA's expanded prefill: V narrower than Q and K)
    chunk=st.integers(1, 200),
    context=st.sampled_from([0, 0, 1, 63, 64, 65, 300]),
    seed=st.integers(0, 2**16),
)
def test_prefill_matches_reference(kv_heads, group, head_dim, narrow_values, chunk, context, seed, march) -> None:
    """A chunk of L queries after `context` cached keys: query i sees keys up to
    context + i. K and V are the halves of a (S, 2, Hk, D) gather and q a view
    of a fused projection, as gqa_paged_attention passes them."""
    g = torch.Generator().manual_seed(seed)
    Hk, H, D, L = kv_heads, kv_heads * group, head_dim, chunk
    S = context + L
    qkv = torch.randn(L, H + 2 * Hk, D, generator=g)
    q, kv = qkv[:, :H], torch.randn(S, 2, Hk, D, generator=g)
    # A fresh (S, Hk, 64) tensor: .contiguous() of the slice keeps its strides when S = Hk = 1.
    k, v = kv[:, 0], (torch.empty(S, Hk, 64).copy_(kv[:, 1, :, :64]) if narrow_values else kv[:, 1])
    assert attn_kernels.prefill_usable(q, k, v)
    out, lse = attn_kernels.prefill_attention(q, k, v, D**-0.5)
    want, want_lse = reference(q, k, v, D**-0.5)
    torch.testing.assert_close(out.double(), want, **TOL)
    torch.testing.assert_close(lse.double(), want_lse, **TOL)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    group=st.sampled_from([1, 3]),
    queries=st.integers(1, 150),
    keys=st.integers(1, 300),
    seed=st.integers(0, 2**16),
)
def test_unmasked_prefill_matches_reference(group, queries, keys, seed, march) -> None:
    """causal=False (DCP's context shards): every query sees every key, with
    more queries than keys or fewer."""
    g = torch.Generator().manual_seed(seed)
    q, kv = torch.randn(queries, 2 * group, 64, generator=g), torch.randn(keys, 2, 2, 64, generator=g)
    out, lse = attn_kernels.prefill_attention(q, kv[:, 0], kv[:, 1], 0.125, causal=False)
    for i in range(queries):  # a single query that is the last key's position sees them all
        want, want_lse = reference(q[i : i + 1], kv[:, 0], kv[:, 1], 0.125)
        torch.testing.assert_close(out[i].double(), want[0], **TOL)
        torch.testing.assert_close(lse[i].double(), want_lse[0], **TOL)


def test_causal_attention_takes_the_kernel_for_any_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """causal_attention runs every CPU call in the kernel, one query or many, fp32 or bf16
    (AMX-BF16's tiles, or widened): equal to PyTorch's path (CTXPAR_KERNELS=0) within
    float rounding."""
    from ctxpar.layers.attention.backend import causal_attention

    calls = []
    real = attn_kernels.prefill_attention
    monkeypatch.setattr(attn_kernels, "prefill_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(5)
    shapes = [(1, 300, torch.float32), (63, 300, torch.float32), (264, 400, torch.float32), (40, 90, torch.bfloat16)]
    for L, S, dtype in shapes:
        q, kv = torch.randn(L, 9, 64, generator=g).to(dtype), torch.randn(S, 2, 3, 64, generator=g).to(dtype)
        out = causal_attention(q, kv[:, 0], kv[:, 1], 0.125)
        assert out.dtype == dtype
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("CTXPAR_KERNELS", "0")
            want = causal_attention(q, kv[:, 0], kv[:, 1], 0.125)
        tol = TOL if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}  # bf16's rounding of the output
        torch.testing.assert_close(out.float(), want.float(), **tol)
    assert len(calls) == 4


def test_bf16_cache_matches_reference_on_its_values(march: str) -> None:
    """A bfloat16 cache is widened exactly to float32 in the kernel: the result
    equals float64 attention over the same (rounded) values."""
    g = torch.Generator().manual_seed(3)
    Hk, H, D, lengths = 3, 9, 64, [1, 300, 1000]
    slots, starts, num_slots = paged(lengths, 16, g)
    cache = torch.randn(num_slots, 2, Hk, D, generator=g).bfloat16()
    q = torch.randn(len(lengths), H, D, generator=g).bfloat16()
    out, _ = attn_kernels.paged_decode(q, cache, slots, starts, Hk, D, (2 * Hk * D, D, Hk * D), 0.125)
    for b in range(len(lengths)):
        kv = cache[slots[starts[b] : starts[b + 1]]]
        want, _ = reference(q[b : b + 1], kv[:, 0], kv[:, 1], 0.125)
        torch.testing.assert_close(out[b].double(), want[0], **TOL)


def test_usable_only_where_the_kernels_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    q, kv = torch.zeros(4, 4, 64), torch.zeros(8, 2, 2, 64)
    assert attn_kernels.prefill_usable(q, kv[:, 0], kv[:, 1])
    tiles = bool(kernels.loaded().prefill_attention_bf16_supports(64, 64))  # bf16: AMX-BF16's tiles, else widened
    assert attn_kernels.prefill_usable(q.bfloat16(), kv[:, 0].bfloat16(), kv[:, 1].bfloat16()) == tiles
    assert not attn_kernels.prefill_usable(q.half(), kv[:, 0].half(), kv[:, 1].half())
    assert not attn_kernels.prefill_usable(q.transpose(1, 2), kv[:, 0], kv[:, 1])  # a head's row must be contiguous
    cache = torch.zeros(8, 2, 2, 16)
    assert attn_kernels.usable(cache, 16)
    assert not attn_kernels.usable(cache, 12)  # not a multiple of the kernel's 8-float vectors
    assert not attn_kernels.usable(cache.half(), 16)  # float32 and bfloat16 only
    assert not attn_kernels.usable(cache.transpose(0, 1), 16)  # strides assume a contiguous cache
    monkeypatch.setenv("CTXPAR_KERNELS", "0")
    assert not attn_kernels.usable(cache, 16) and not attn_kernels.prefill_usable(q, kv[:, 0], kv[:, 1])


def test_missing_compiler_warns_and_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("CTXPAR_CACHE", str(tmp_path))
    kernels._library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="no C.. compiler"):
            assert not attn_kernels.usable(torch.zeros(4, 2, 1, 8), 8)
    finally:
        kernels._library.cache_clear()


# The outputs' largest difference between the paths: float32 rounding, or in bf16 one
# unit in the last place (8 significant bits) of the largest values here (|x| < 16).
BENCH_TOL = {"float32": 1e-5, "bfloat16": 16 * 2.0**-7}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_kernels_prints_ratios_of_equal_outputs(dtype: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`ctxpar bench kernels`: every case timed both ways, outputs equal within rounding;
    the prefill rows with the kernel's GFLOP/s."""
    from ctxpar import cli
    from ctxpar.bench.kernels import DECODE_CASES, ELEMENTWISE_TOKENS, PREFILL_CASES, PROJECTION_CASES

    assert cli.main(["bench", "kernels", "--repeat", "1", "--dtype", dtype]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split("|") for line in lines if line.count("|") in (4, 5) and "kernel ms" not in line]
    assert len(rows) == len(DECODE_CASES) + len(PREFILL_CASES) + len(ELEMENTWISE_TOKENS) + len(PROJECTION_CASES)
    assert sum(len(row) == 6 for row in rows) == len(PREFILL_CASES)
    for _, kernel_ms, torch_ms, ratio, diff, *rate in rows:
        assert float(kernel_ms) > 0 and float(torch_ms) > 0 and ratio.strip().endswith("x")
        assert float(diff) < BENCH_TOL[dtype] and all(float(r) > 0 for r in rate)


@pytest.mark.parametrize("per_core", [False, True])
def test_bench_kernels_quant_prints_rates_against_the_peak(
    per_core: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ctxpar bench kernels --quant`: each format, shape and row count a row with the int8
    product's time, GOP/s (2 per multiply-add of that time), its fraction of the peak and
    bf16's time; then the peak. Shapes cut down to one small projection: the command's
    own are a 1B and an 8B layer's."""
    from ctxpar import cli
    from ctxpar.bench import kernels as bench_kernels

    monkeypatch.setattr(bench_kernels, "QUANT_SHAPES", {"tiny": {"o": (48, 256)}})
    monkeypatch.setattr(bench_kernels, "PEAK_ROUNDS", 10_000)
    flags = ["--per-core"] if per_core else []
    threads = torch.get_num_threads()
    try:
        argv = ["bench", "kernels", "--quant", "--rows", "4", "16", "--repeat", "1", "--formats", "Q4_0", "Q8_0"]
        assert cli.main([*argv, *flags]) == 0
    finally:
        torch.set_num_threads(threads)  # --per-core takes one
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if "x (48, 256)" in line]
    assert [row[0].split()[0] for row in rows] == ["Q4_0", "Q4_0", "Q8_0", "Q8_0"]
    for label, int8_ms, rate, of_peak, bf16_ms, ratio in rows:
        mops = 2 * int(label.split()[3]) * 48 * 256 / 1e6  # the ms printed to 0.005, the rate to 0.5
        assert mops / (float(int8_ms) + 0.005) - 0.5 <= float(rate) <= mops / max(float(int8_ms) - 0.005, 1e-9) + 0.5
        assert of_peak.strip().endswith("%") and float(bf16_ms) > 0 and ratio.strip().endswith("x")
    assert re.search(r"int8 peak: \d+ GOP/s on \d+ threads", out)


def test_unwritable_cache_builds_once_in_the_temporary_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path, cached_cxx: str
) -> None:
    """A cache that cannot be written (here: under a regular file) is no failure:
    the library goes to a directory of this user's under the temporary one. That
    fresh directory gets one library, reused by the next load (one build: each
    takes seconds). The build runs through ``cached_cxx`` (g++ once a session)."""
    monkeypatch.setenv("CXX", cached_cxx)
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("CTXPAR_CACHE", str(blocker / "cache"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    kernels._library.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert kernels._library() is not None
        built = list((tmp_path / "tmp").glob("ctxpar-kernels-*/*"))
        assert [p.suffix for p in built] == [".so"]
        mtime = built[0].stat().st_mtime_ns
        kernels._library.cache_clear()
        assert kernels._library() is not None and built[0].stat().st_mtime_ns == mtime
    finally:
        kernels._library.cache_clear()


def test_dcp_attention_lse_takes_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP's attention_lse (each query over its own prefix of a shard's keys) runs rows
    in the prefill kernel: out and lse equal PyTorch's path (CTXPAR_KERNELS=0) for
    GQA K/V and for MLA-like latents."""
    from ctxpar.layers.attention.backend import attention_lse

    g = torch.Generator().manual_seed(11)
    L, m = 94, 300
    counts = torch.randint(1, m + 1, (L,), generator=g).sort().values
    kv, lat = torch.randn(m, 2, 3, 64, generator=g), torch.randn(m, 1, 128, generator=g)
    real, calls = attn_kernels.prefill_attention, []
    monkeypatch.setattr(attn_kernels, "prefill_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for q, k, v in [
        (torch.randn(L, 9, 64, generator=g), kv[:, 0], kv[:, 1]),
        (torch.randn(L, 4, 128, generator=g), lat, lat),
    ]:
        calls.clear()
        out, lse = attention_lse(q, k, v, 0.125, counts)
        monkeypatch.setenv("CTXPAR_KERNELS", "0")
        want, want_lse = attention_lse(q, k, v, 0.125, counts)
        monkeypatch.delenv("CTXPAR_KERNELS")
        assert calls == [1]
        torch.testing.assert_close(out, want, **TOL)
        torch.testing.assert_close(lse, want_lse, **TOL)


def test_key_counts_the_kernel_cannot_read_are_refused() -> None:
    """The kernel reads L int64 counts: another shape, dtype or a count outside [1, S] is a
    ValueError before it runs (python -O keeps the checks)."""
    q, kv = torch.randn(3, 2, 64), torch.randn(5, 2, 1, 64)
    for counts, words in [
        (torch.tensor([1, 2]), "(3,)"),
        (torch.tensor([1, 2, 3], dtype=torch.int32), "int64"),
        (torch.tensor([0, 2, 3]), "[1, 5]"),
        (torch.tensor([1, 2, 6]), "[1, 5]"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):
            attn_kernels.prefill_attention(q, kv[:, 0], kv[:, 1], 0.125, counts=counts)
