"""The packed fp32 and bf16 projections (ctxpar/kernels/gemv.cpp, layers/linear.py)
against the product in float64, over random shapes (widths that neither the
panels nor the vectors divide, odd bf16 widths, strided input rows, row counts
past a work block), on the native and the AVX2 builds; and the packings' index maps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxpar import kernels
from ctxpar.layers.linear import PanelWeight, can_pack, linear, pack_weight, packed
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
    got = kernels.linear_packed(x, PanelWeight.pack(w).data, out_features, b)
    assert got.shape == (n, out_features) and got.dtype == torch.float32
    bound = 1e-6 * (x.double().abs() @ w.double().abs().T + 1)
    assert torch.all((got.double() - want).abs() <= bound)
    assert linear(x, PanelWeight.pack(w), b).dtype == torch.bfloat16  # a bf16 model's activations stay bf16


@SETTINGS
@given(out_features=st.integers(1, 70), in_features=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_bf16_panel_layout_index_map(march: str, out_features: int, in_features: int, seed: int) -> None:
    """Row o, column i of W sits at [o // NP][i // 2][o % NP][i % 2]; padding is zero."""
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)).bfloat16()
    p = PanelWeight.pack(w)
    width, pairs = kernels.panel_width(), -(-in_features // 2)
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
    width = kernels.panel_width()
    assert p.data.shape == (-(-out_features // width), in_features, width) and p.out_features == out_features
    for o in range(out_features):
        assert torch.equal(p.data[o // width, :, o % width], w[o])
    flat = p.data.transpose(1, 2).reshape(-1, in_features)
    assert not flat[out_features:].any()


def test_panel_width_is_two_vectors(march: str) -> None:
    assert kernels.panel_width() == (16 if march == "haswell" else 32 if "avx512f" in cpu_info().flags else 16)


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
