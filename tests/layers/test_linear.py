"""The packed fp32 and bf16 projections (ctxpar/kernels/gemv.cpp, layers/linear.py)
against the product in float64, over random shapes (widths that neither the
panels nor the vectors divide, odd bf16 widths, strided input rows, row counts
past a work block), on the native and the AVX2 builds (native: AMX's tiles for bf16
where the CPU has AMX-BF16); bf16's order of summation; and the packings' index maps."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxpar.kernels import panels
from ctxpar.layers.linear import Linear, PanelWeight, can_pack, linear, pack_weight, packed
from ctxpar.machine import cpu_info

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(
    n=st.one_of(st.integers(0, 30), st.integers(180, 260)),
    in_features=st.integers(1, 200),
    out_features=st.integers(0, 100),
    pad=st.integers(0, 5),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_packed_linear_matches_float64(
    march: str, n: int, in_features: int, out_features: int, pad: int, bias: bool, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features + pad, generator=g)[:, :in_features]  # rows `pad` floats apart
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    got = linear(x, PanelWeight.pack(w), b)
    assert got.shape == (n, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@SETTINGS
@given(
    n=st.one_of(st.integers(0, 30), st.integers(180, 200)),
    in_features=st.integers(1, 120),
    out_features=st.integers(0, 100),
    pad=st.integers(0, 3),
    first=st.integers(0, 1),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_packed_bf16_linear_matches_float64(
    march: str, n: int, in_features: int, out_features: int, pad: int, first: int, bias: bool, seed: int
) -> None:
    """bf16 weights and inputs, exact products summed in float32: within float32's
    rounding of the sum of |products|, whichever path (dot-product instruction or widened).
    Input rows `pad` apart, from column `first` (1: rows that do not start on a 4-byte pair)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, first + in_features + pad, generator=g).bfloat16()[:, first : first + in_features]
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g) if bias else None
    products = x.double() @ w.double().T
    want = products + (b.double() if bias else 0)
    got = panels.linear_packed(x, PanelWeight.pack(w).data, out_features, b)
    assert got.shape == (n, out_features) and got.dtype == torch.float32
    bound = 1e-6 * (x.double().abs() @ w.double().abs().T + 1)
    assert torch.all((got.double() - want).abs() <= bound)
    assert linear(x, PanelWeight.pack(w), b).dtype == torch.bfloat16  # a bf16 model's activations stay bf16
    # bf16 out, as `linear` asks for it: the float32 result's bits rounded as PyTorch rounds
    assert torch.equal(linear(x, PanelWeight.pack(w), b), got.bfloat16())


def test_bf16_out_rounds_as_pytorch(march: str) -> None:
    """Written as bf16 by the kernel, each output is what .to(torch.bfloat16) makes of the
    float32 one: ties to even, denormals rounded (not flushed), overflow to infinity."""
    bits = [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x00008000, 0x00018000, 0x80017FFF, 0x7F7FFFFF, 0xFF800000, 0x1]
    bias = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.zeros(3, 4, dtype=torch.bfloat16)  # every sum 0: the outputs are the biases
    p = PanelWeight.pack(torch.ones(len(bits), 4, dtype=torch.bfloat16)).data
    got = panels.linear_packed(x, p, len(bits), bias, out_dtype=torch.bfloat16)
    assert torch.equal(got, bias.expand(3, -1).bfloat16())
    nan = panels.linear_packed(x, p, 1, torch.tensor([float("nan")]), out_dtype=torch.bfloat16)
    assert nan.isnan().all()


@pytest.mark.parametrize("n,in_features", [(1500, 300), (900, 1024), (37, 4096)])
def test_bf16_row_blocks_and_tiles(march: str, n: int, in_features: int) -> None:
    """bf16 past a row block of ~256 KB, inputs whose pairs fill whole K tiles of 32 (read
    in place, a last group of 16 padded) or not (a padded copy): within float32's rounding."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, in_features + 2, generator=g).bfloat16()[:, :in_features]
    w = torch.randn(70, in_features, generator=g).bfloat16()
    b = torch.randn(70, generator=g)
    want = x.double() @ w.double().T + b.double()
    got = panels.linear_packed(x, PanelWeight.pack(w).data, 70, b).double()
    assert torch.all((got - want).abs() <= 1e-6 * (x.double().abs() @ w.double().abs().T + 1))


POWERS = [1.0, -1.0, 3.0, 0.5, 2.0**24, -(2.0**24), 2.0**25, -(2.0**25)]


@SETTINGS
@given(
    tiles=st.integers(2, 6),
    short=st.integers(0, 31),
    n=st.integers(1, 40),
    out_features=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_bf16_sums_in_input_order_then_bias(
    march: str, tiles: int, short: int, n: int, out_features: int, seed: int
) -> None:
    """Every output is its products summed in float32 in input order, then the bias. Each
    row's input is 1 at one column per 32 (a K tile) and 0 elsewhere, the weights and
    biases powers of two and 3 up to 2^25 (every product exact), so how a tile's products
    meet does not matter, and the order of the tiles and the bias does: 1 + 2^24 - 2^24 is
    0 in that order and 1 in others. Summing the tiles in another order, or adding the
    bias first, fails this."""
    rng = np.random.default_rng(seed)
    cols = 32 * tiles - short
    w = rng.choice(POWERS, (out_features, cols)).astype(np.float32)
    bias = rng.choice(POWERS, out_features).astype(np.float32)
    x = np.zeros((n, cols), np.float32)
    picks = [[rng.integers(32 * t, min(32 * t + 32, cols)) for t in range(tiles)] for _ in range(n)]
    for m, columns in enumerate(picks):
        x[m, columns] = 1
    want = np.zeros((n, out_features), np.float32)
    for t in range(tiles):  # float32 sums, tile after tile
        want += np.stack([w[:, columns[t]] for columns in picks])
    want += bias
    xb, wb = torch.from_numpy(x).bfloat16(), torch.from_numpy(w).bfloat16()
    got = panels.linear_packed(xb, PanelWeight.pack(wb).data, out_features, torch.from_numpy(bias))
    assert torch.equal(got, torch.from_numpy(want))


def test_bf16_sum_order_tells_orders_apart(march: str) -> None:
    """The cases above can fail: 1, 2^24, -2^24 in three tiles, bias 0, gives 0; the
    reverse order 1; and with 2^24, 1 and bias -2^24, 0 where the bias first gives 1."""
    x = torch.zeros(1, 96, dtype=torch.bfloat16)
    x[0, [5, 40, 70]] = 1
    w = torch.zeros(2, 96, dtype=torch.bfloat16)
    w[0, [5, 40, 70]] = torch.tensor([1.0, 2.0**24, -(2.0**24)]).bfloat16()
    w[1, [5, 40]] = torch.tensor([2.0**24, 1.0]).bfloat16()
    got = panels.linear_packed(x, PanelWeight.pack(w).data, 2, torch.tensor([0.0, -(2.0**24)]))
    assert got.tolist() == [[0.0, 0.0]]


@SETTINGS
@given(out_features=st.integers(1, 70), in_features=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_bf16_panel_layout_index_map(march: str, out_features: int, in_features: int, seed: int) -> None:
    """Row o, column i of W sits at [o // NP][i // 2][o % NP][i % 2]; padding is zero."""
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)).bfloat16()
    p = PanelWeight.pack(w)
    width, pairs = panels.panel_width(), -(-in_features // 2)
    assert p.data.shape == (-(-out_features // width), pairs, width, 2) and p.data.dtype == torch.bfloat16
    for o in range(out_features):
        assert torch.equal(p.data[o // width, :, o % width].reshape(-1)[:in_features], w[o])
    assert int(p.data.count_nonzero()) == int(w.count_nonzero())  # the padding holds nothing else


@SETTINGS
@given(out_features=st.integers(1, 70), in_features=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_panel_layout_index_map(march: str, out_features: int, in_features: int, seed: int) -> None:
    """Row o, column i of W sits at [o // NP][i][o % NP]; padding rows are zero."""
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    p = PanelWeight.pack(w)
    width = panels.panel_width()
    assert p.data.shape == (-(-out_features // width), in_features, width) and p.out_features == out_features
    for o in range(out_features):
        assert torch.equal(p.data[o // width, :, o % width], w[o])
    flat = p.data.transpose(1, 2).reshape(-1, in_features)
    assert not flat[out_features:].any()


def test_panel_width_is_two_vectors(march: str) -> None:
    assert panels.panel_width() == (16 if march == "haswell" else 32 if "avx512f" in cpu_info().flags else 16)


def test_what_gets_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(8, 4)
    assert can_pack(w) and isinstance(packed(w), PanelWeight)
    monkeypatch.setenv("CTXPAR_KERNELS", "0")
    assert can_pack(w) and packed(w).is_mkldnn  # oneDNN's packed layout then
    bf16 = w.bfloat16()
    assert can_pack(bf16) == (packed(bf16) is not bf16)  # oneDNN's, where the CPU has native bf16
    monkeypatch.delenv("CTXPAR_KERNELS")
    assert can_pack(bf16) and isinstance(packed(bf16), PanelWeight)


def test_pack_weight_replaces_the_parameter() -> None:
    layer = torch.nn.Linear(6, 5, bias=False)
    x = torch.randn(3, 6)
    want = layer(x)
    pack_weight(layer, "weight")
    assert isinstance(layer.weight, PanelWeight) and "weight" not in dict(layer.named_parameters())
    torch.testing.assert_close(linear(x, layer.weight), want)


@pytest.mark.parametrize("n,in_features", [(1500, 300), (900, 1100)])
def test_inputs_larger_than_l2_go_in_row_blocks(march: str, n: int, in_features: int) -> None:
    """Past 2^18 input floats the kernel splits the rows into blocks (a last partial one included)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, in_features + 3, generator=g)[:, :in_features]
    w, b = torch.randn(70, in_features, generator=g), torch.randn(70, generator=g)
    want = x.double() @ w.double().T + b.double()
    torch.testing.assert_close(linear(x, PanelWeight.pack(w), b).double(), want, rtol=1e-5, atol=2e-4)


def test_no_rows_or_no_outputs() -> None:
    """A step may want no logits (n = 0), and a rank's range of the vocabulary may be empty."""
    w = PanelWeight.pack(torch.randn(3, 5))
    assert linear(torch.zeros(0, 5), w).shape == (0, 3)
    empty = PanelWeight(w.data[:0], 0)
    assert linear(torch.randn(2, 5), empty).shape == (2, 0)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the process's resident memory from /proc")
def test_a_linear_leaves_its_weight_unwritten_until_loading() -> None:
    """Every weight comes from the checkpoint: a Linear built for a GiB of float32 weight
    (a MoE layer's experts, most of which a GGUF keeps as blocks) must not write it,
    as nn.Linear's random fill would (a Qwen3-30B-A3B needed ~120 GB to load)."""
    before = _resident_bytes()
    layer = Linear(16384, 16384, bias=False)  # 1 GiB of float32
    grown = _resident_bytes() - before
    assert layer.weight.shape == (16384, 16384)
    assert grown < 64 * 2**20, f"building the layer made {grown / 2**20:.0f} MiB resident"
