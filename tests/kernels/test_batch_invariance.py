"""Batch invariance, kernel by kernel (docs/architecture.md, "The same bits whatever else
runs"): a row's result is the same bits whatever other rows share the call. For each
kernel a row can take, hypothesis draws a batch; every row (and every run of rows)
computed alone must equal its row of the whole call, compared with ``==``.

- projections: block-quantized weights in every GGUF format on every build this CPU
  runs (AVX-512 VNNI with AMX where present, AVX2, scalar), fp32 panels, and bf16
  panels on every path this CPU runs (AMX-BF16's tiles, AVX-512 BF16, AVX2);
- RMSNorm (with and without the residual), SiLU·up, rope, in fp32 and bf16;
- attention: prefill chunks (a prompt's queries cut anywhere, as chunked prefill and
  PCP cut them), queries with a key count each (DCP's shards) and decode rows alone
  or in a batch, fp32 and quantized caches;
- the sampler's logprobs, per row or in one call (prompt logprobs).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxpar import kernels
from ctxpar.engine.sample.sampler import logprobs_of
from ctxpar.kernels import attention_kernels as attn_kernels
from ctxpar.kernels import elementwise, panels
from ctxpar.layers.kv_quant import KVQuant, default_runs
from ctxpar.layers.linear import PanelWeight
from ctxpar.layers.quant_blocks import FORMATS, decode
from ctxpar.layers.quant_linear import QuantWeight, quant_linear
from ctxpar.machine import cpu_info
from helpers.gguf_blocks import random_blocks
from helpers.kernel_builds import VNNI_BUILD

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the compiled kernels")

SETTINGS = settings(max_examples=15, deadline=None)
# The quantized paths: native (AMX-INT8's tiles where the CPU has them), AVX-512 VNNI
# without AMX (on a CPU with AMX), AVX-VNNI's 256-bit dot products, AVX2, scalar.
BUILDS = ["native", *VNNI_BUILD, *(["alderlake"] if "avx_vnni" in cpu_info().flags else []), "haswell", "x86-64"]
# bf16's paths: native (AMX's tiles where the CPU has AMX-BF16), AVX-512 BF16's dot
# products without AMX (cooperlake), AVX2's widened pairs.
BF16_BUILDS = ["native", *(["cooperlake"] if "avx512_bf16" in cpu_info().flags else []), "haswell"]


def random_weight(name: str, rows: int, cols: int, rng: np.random.Generator) -> QuantWeight:
    """A QuantWeight of random blocks with finite fp16 fields."""
    return QuantWeight.from_decoded(decode(random_blocks(name, rows, cols, rng), name, cols))


def split_points(n: int, data: st.DataObject) -> list[int]:
    """Cut points of [0, n) into runs: 0 < ... < n."""
    cuts = data.draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4, unique=True)) if n > 1 else []
    return [0, *sorted(c for c in cuts if 0 < c < n), n]


def assert_rows_alone(run, x: torch.Tensor, data: st.DataObject) -> None:
    """run(x) row-wise equals run over runs of x's rows, and each of a few rows alone."""
    whole = run(x)
    bounds = split_points(x.shape[0], data)
    parts = torch.cat([run(x[a:b]) for a, b in zip(bounds, bounds[1:])])
    assert torch.equal(parts, whole)
    for r in data.draw(st.lists(st.integers(0, x.shape[0] - 1), min_size=1, max_size=3)):
        assert torch.equal(run(x[r : r + 1]), whole[r : r + 1]), r


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("name", sorted(FORMATS))
@SETTINGS
@given(data=st.data())
def test_quantized_projection(name: str, build: str, data: st.DataObject) -> None:
    lib = kernels._library(build)
    assert lib is not None
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    block = 256 if FORMATS[name].block == 256 else 32
    cols = block * data.draw(st.integers(1, 3 if block == 256 else 12))
    out = data.draw(st.integers(1, 40))
    w = random_weight(name, out, cols, rng)
    n = data.draw(st.integers(1, 70))  # across AMX's groups of 16 rows and the rows after them
    x = torch.from_numpy((rng.standard_normal((n, cols)) * rng.uniform(0.1, 3, (n, 1))).astype(np.float32))
    bias = torch.randn(out) if data.draw(st.booleans()) else None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "_library", lambda march="native": lib)
        assert_rows_alone(lambda r: quant_linear(r, w, bias), x, data)


@SETTINGS
@given(data=st.data())
def test_panel_projection(data: st.DataObject) -> None:
    out, cols = data.draw(st.integers(1, 80)), data.draw(st.integers(1, 200))
    w = PanelWeight.pack(torch.randn(out, cols))
    x = torch.randn(data.draw(st.integers(1, 60)), cols)
    assert_rows_alone(lambda rows: panels.linear_packed(rows, w.data, out), x, data)


@pytest.mark.parametrize("build", BF16_BUILDS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_bf16_projection(build: str, data: st.DataObject) -> None:
    """Row r of a call of M rows (M across 1..70: AMX's groups of 16, a padded last
    group) == the call of row r alone, for every r; inputs whose pairs fill whole K
    tiles (read in place, rows `pad` apart) and inputs that do not (padded copies)."""
    lib = kernels._library(build)
    assert lib is not None
    whole_tiles = data.draw(st.booleans())
    cols = 32 * data.draw(st.integers(1, 6)) if whole_tiles else data.draw(st.integers(1, 200))
    out, n, pad = data.draw(st.integers(1, 80)), data.draw(st.integers(1, 70)), data.draw(st.sampled_from([0, 2, 6]))
    x = (torch.randn(n, cols + pad) * torch.rand(n, 1) * 3).bfloat16()[:, :cols]
    bias = torch.randn(out) if data.draw(st.booleans()) else None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "_library", lambda march="native": lib)
        w = PanelWeight.pack(torch.randn(out, cols).bfloat16())  # the build's panel width
        run = lambda rows: panels.linear_packed(rows, w.data, out, bias)
        whole = run(x)
        assert_rows_alone(run, x, data)
        for r in range(n):
            assert torch.equal(run(x[r : r + 1]), whole[r : r + 1]), r


def test_bf16_path_is_the_cpus() -> None:
    """The native build takes AMX's tiles for bf16 exactly where the CPU has AMX-BF16 (and
    Linux grants the tile state, which every kernel since 5.16 does)."""
    assert panels.bf16_tiles() == ("amx_bf16" in cpu_info().flags)
    if "cooperlake" in BF16_BUILDS:
        assert not kernels._library("cooperlake").linear_bf16_tiles()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@SETTINGS
@given(data=st.data())
def test_elementwise(dtype: torch.dtype, data: st.DataObject) -> None:
    n, heads, dim = data.draw(st.integers(1, 40)), data.draw(st.integers(1, 4)), 2 * data.draw(st.integers(4, 40))
    x, weight = torch.randn(n, heads * dim).to(dtype), torch.randn(heads * dim).to(dtype)
    residual = torch.randn(n, heads * dim).to(dtype)
    assert_rows_alone(lambda rows: elementwise.rms_norm(rows, weight, 1e-5), x, data)

    def with_residual(rows: torch.Tensor) -> torch.Tensor:
        own = rows.clone()
        return torch.cat([elementwise.rms_norm(rows, weight, 1e-5, own), own], dim=1)

    assert_rows_alone(with_residual, residual, data)
    assert_rows_alone(lambda rows: elementwise.silu_mul(rows.contiguous()), x, data)
    angles = torch.randn(n, dim // 2)
    cos, sin = angles.cos(), angles.sin()

    def rope(rows: torch.Tensor) -> torch.Tensor:
        r = rows.shape[0]
        idx = [i for i in range(n) if torch.equal(x[i], rows[0])][0]  # the rows' own angles
        y = rows.clone().view(r, heads, dim)
        elementwise.rope_(y, cos[idx : idx + r].contiguous(), sin[idx : idx + r].contiguous())
        return y.view(r, -1)

    assert_rows_alone(rope, x, data)


@SETTINGS
@given(data=st.data())
def test_prefill_attention_any_chunks(data: st.DataObject) -> None:
    """A prompt's queries cut into chunks (chunked prefill, PCP's chunks, a prefix-cache
    hit's suffix): each chunk's queries over their causal prefix are the whole prompt's."""
    kv_heads, group, dim = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)), 64
    S = data.draw(st.integers(1, 300))
    L = data.draw(st.integers(1, S))
    q, k, v = torch.randn(L, kv_heads * group, dim), torch.randn(S, kv_heads, dim), torch.randn(S, kv_heads, dim)
    whole, whole_lse = attn_kernels.prefill_attention(q, k, v, 0.125)
    bounds = split_points(L, data)
    for a, b in zip(bounds, bounds[1:]):
        keys = S - L + b  # the chunk's last query sees this many keys
        out, lse = attn_kernels.prefill_attention(q[a:b], k[:keys], v[:keys], 0.125)
        assert torch.equal(out, whole[a:b]) and torch.equal(lse, whole_lse[a:b])


@pytest.mark.parametrize("kv_dtype", ["model", "int8"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_prefill_attention_key_counts(kv_dtype: str, data: st.DataObject) -> None:
    """Queries with a key count each (DCP: a query over the prefix of a shard's keys up to
    its position): a query's result depends on its own count and keys only, the same bits
    in any run of queries and alone over just its keys (a quantized cache's zero codes
    included: a key a query does not see weighs exactly 0)."""
    kv_heads, group, dim = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)), 64
    S, L = data.draw(st.integers(1, 300)), data.draw(st.integers(1, 80))
    counts = torch.tensor(sorted(data.draw(st.lists(st.integers(1, S), min_size=L, max_size=L))))
    if data.draw(st.booleans()):
        counts = counts[torch.randperm(L)]  # the kernel takes any order
    q, kv = torch.randn(L, kv_heads * group, dim), torch.randn(S, 2, kv_heads, dim)
    quant = KVQuant.of(kv_dtype, (2, kv_heads, dim), default_runs((2, kv_heads, dim)))
    rows = kv if quant is None else quant.quantize(kv)

    def attend(queries: torch.Tensor, keys: torch.Tensor, n: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        if quant is None:
            return attn_kernels.prefill_attention(queries, keys[:, 0], keys[:, 1], 0.125, counts=n)
        return attn_kernels.prefill_attention_quant(queries, keys, quant, 0.125, counts=n)

    whole, whole_lse = attend(q, rows, counts)
    bounds = split_points(L, data)
    for a, b in zip(bounds, bounds[1:]):
        out, lse = attend(q[a:b], rows[: int(counts[a:b].max())], counts[a:b].clone())
        assert torch.equal(out, whole[a:b]) and torch.equal(lse, whole_lse[a:b])
    for i in data.draw(st.lists(st.integers(0, L - 1), min_size=1, max_size=3)):
        out, lse = attend(q[i : i + 1], rows[: int(counts[i])], counts[i : i + 1].clone())
        assert torch.equal(out[0], whole[i]) and torch.equal(lse[0], whole_lse[i]), i


@pytest.mark.parametrize("kv_dtype", ["model", "int8", "fp8_e4m3"])
@SETTINGS
@given(data=st.data())
def test_decode_rows_alone_or_batched(kv_dtype: str, data: st.DataObject) -> None:
    kv_heads, group, dim = 3, 3, 64
    rows = data.draw(st.integers(1, 12))
    lengths = data.draw(st.lists(st.integers(1, 700), min_size=rows, max_size=rows))
    slots_of = [torch.randperm(2048)[:n] for n in lengths]  # each row's slots, anywhere in the cache
    entries = torch.randn(2048, 2, kv_heads, dim)
    quant = KVQuant.of(kv_dtype, (2, kv_heads, dim), default_runs((2, kv_heads, dim)))
    cache = entries if quant is None else quant.quantize(entries)
    q = torch.randn(rows, kv_heads * group, dim)

    def decode_rows(idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        slots = torch.cat([slots_of[i] for i in idx])
        starts = torch.tensor([0, *np.cumsum([lengths[i] for i in idx])], dtype=torch.int64)
        return attn_kernels.gqa_paged_decode(q[idx], cache, slots, starts, 0.125, quant)

    out, lse = decode_rows(list(range(rows)))
    for r in data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=3)):
        alone, alone_lse = decode_rows([r])
        assert torch.equal(alone[0], out[r]) and torch.equal(alone_lse[0], lse[r])


@SETTINGS
@given(data=st.data())
def test_logprobs_per_row(data: st.DataObject) -> None:
    k, vocab = data.draw(st.integers(1, 20)), data.draw(st.integers(2, 3000))
    logits = torch.randn(k, vocab) * data.draw(st.floats(0.1, 30))
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=k, max_size=k))
    together = logprobs_of(logits, ids, 5)
    for r in range(k):
        assert logprobs_of(logits[r : r + 1], ids[r : r + 1], 5)[0] == together[r]
