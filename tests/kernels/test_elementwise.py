"""The compiled elementwise kernels (ctxpar/kernels/elementwise.cpp) against
the formulas in float64, over random shapes (widths that the vectors do not
divide, strided rows), large and tiny values; in bf16 against PyTorch's bf16 ops
(the same rounding points); and the layers that call them against PyTorch's path
(CTXPAR_KERNELS=0)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxpar.kernels import elementwise
from ctxpar.layers.norm import RMSNorm
from ctxpar.layers.rotary import apply_rotary, apply_rotary_

TOL = dict(rtol=1e-5, atol=1e-5)
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def test_kernels_serve_fp32_and_bf16_on_the_cpu() -> None:
    assert elementwise.usable(torch.zeros(2, 8)) and elementwise.usable(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert not elementwise.usable(torch.zeros(2, 8, dtype=torch.float64))
    assert not elementwise.usable(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.bfloat16))  # one dtype a call
    with pytest.raises(ValueError, match="float32"):
        elementwise.hadamard_(torch.zeros(2, 1, 8, dtype=torch.bfloat16), 1.0)


# A bf16 result off by at most one unit in its last place (8 significant bits): the
# kernels round where PyTorch's bf16 ops round, from floats summed in another order.
BF16_ULP = dict(rtol=2.0**-7, atol=1e-30)


@SETTINGS
@given(n=st.integers(1, 30), dim=st.integers(1, 200), residual=st.booleans(), seed=st.integers(0, 2**16))
def test_bf16_rms_norm_rounds_as_pytorch(march: str, n: int, dim: int, residual: bool, seed: int) -> None:
    """transformers' bf16 RMSNorm: the residual sum rounded (the same bits: one rounding
    of an exact float sum), the row normalised in floats and rounded, times the weight."""
    g = torch.Generator().manual_seed(seed)
    x, weight = (torch.randn(n, dim, generator=g) * 3).bfloat16(), torch.randn(dim, generator=g).bfloat16()
    res = torch.randn(n, dim, generator=g).bfloat16() if residual else None
    summed = res + x if res is not None else x
    xf = summed.float()
    want = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    got = elementwise.rms_norm(x, weight, 1e-6, res)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, **BF16_ULP)
    if res is not None:
        assert torch.equal(res, summed)


@SETTINGS
@given(n=st.integers(1, 30), inter=st.integers(1, 300), scale=st.sampled_from([1.0, 10.0, 120.0]))
def test_bf16_silu_mul_rounds_as_pytorch(march: str, n: int, inter: int, scale: float) -> None:
    """F.silu in bf16 (rounded), then the product with up (rounded)."""
    gate_up = (torch.randn(n, 2 * inter, generator=torch.Generator().manual_seed(n * inter)) * scale).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    got = elementwise.silu_mul(gate_up)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, **BF16_ULP)


@SETTINGS
@given(n=st.integers(1, 30), heads=st.integers(1, 9), half=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_bf16_rope_rounds_once(march: str, n: int, heads: int, half: int, seed: int) -> None:
    """bf16 rows rotated in floats by float32 angles, rounded once: within half a unit of
    the exact rotation of the same bf16 values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, 2 * half, generator=g).bfloat16()
    angles = torch.rand(n, half, generator=g) * 100
    cos, sin = angles.cos(), angles.sin()
    a, b = x.double()[..., :half], x.double()[..., half:]
    c, s = cos.double()[:, None], sin.double()[:, None]
    want = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    elementwise.rope_(x, cos, sin)
    assert (x.double() - want).abs().le(want.abs() * 2.0**-8 + 1e-6).all()


@SETTINGS
@given(
    n=st.integers(1, 40),
    dim=st.integers(1, 200),
    pad=st.integers(0, 9),
    residual=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_matches_formula(march: str, n: int, dim: int, pad: int, residual: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim + pad, generator=g)[:, :dim] * 3  # rows `pad` floats apart
    weight = torch.randn(dim, generator=g)
    res = torch.randn(n, dim, generator=g) if residual else None
    summed = (x.double() + res.double()) if residual else x.double()
    want = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    got = elementwise.rms_norm(x, weight, 1e-6, res)
    torch.testing.assert_close(got.double(), want, **TOL)
    if residual:
        torch.testing.assert_close(res.double(), summed, **TOL)  # the residual stream holds the sum


@SETTINGS
@given(
    n=st.integers(1, 12),
    heads=st.integers(1, 6),
    dim=st.integers(1, 80),
    extra=st.integers(0, 40),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_heads_is_rms_norm_of_each_head(
    march: str, n: int, heads: int, dim: int, extra: int, bf16: bool, seed: int
) -> None:
    """Each head of (n, heads, dim) heads inside wider token rows (Q inside QKV) normalised in place
    with the very bits of rms_norm over the heads as rows, the rest of each row untouched."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    rows = (torch.randn(n, heads * dim + extra, generator=g) * 3).to(dtype)
    weight = torch.randn(dim, generator=g).to(dtype)
    want = elementwise.rms_norm(rows[:, : heads * dim].reshape(n * heads, dim), weight, 1e-6).view(n, heads * dim)
    rest = rows[:, heads * dim :].clone()
    elementwise.rms_norm_heads_(rows[:, : heads * dim].view(n, heads, dim), weight, 1e-6)
    assert torch.equal(rows[:, : heads * dim], want) and torch.equal(rows[:, heads * dim :], rest)


@SETTINGS
@given(
    n=st.integers(1, 40),
    inter=st.integers(1, 300),
    scale=st.sampled_from([1.0, 10.0, 120.0]),
    seed=st.integers(0, 2**16),
)
def test_silu_mul_matches_formula(march: str, n: int, inter: int, scale: float, seed: int) -> None:
    """scale 120 reaches past exp's underflow (-87) on both signs."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(n, 2 * inter, generator=g) * scale
    gate, up = gate_up.double().split(inter, dim=-1)
    want = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(elementwise.silu_mul(gate_up).double(), want, **TOL)


@SETTINGS
@given(
    n=st.integers(1, 40),
    inter=st.integers(1, 300),
    scale=st.sampled_from([1.0, 10.0, 120.0]),
    seed=st.integers(0, 2**16),
)
def test_gelu_tanh_mul_matches_formula(march: str, n: int, inter: int, scale: float, seed: int) -> None:
    """Gemma's activation against tanh's own formula in float64 (the kernel's is x sigmoid(2y));
    scale 120 takes the tanh's argument past exp's underflow on both signs."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(n, 2 * inter, generator=g) * scale
    gate, up = gate_up.double().split(inter, dim=-1)
    want = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3))) * up
    torch.testing.assert_close(elementwise.gelu_tanh_mul(gate_up).double(), want, **TOL)


@SETTINGS
@given(
    n=st.integers(1, 40),
    heads=st.integers(1, 12),
    half=st.integers(1, 40),
    extra=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_rope_in_place_matches_formula(march: str, n: int, heads: int, half: int, extra: int, seed: int) -> None:
    """Heads are rows of a wider token row (as Q and K inside the QKV projection)."""
    g = torch.Generator().manual_seed(seed)
    dim = 2 * half
    qkv = torch.randn(n, (heads + extra) * dim, generator=g)
    x = qkv[:, : heads * dim].view(n, heads, dim)
    angles = torch.rand(n, half, generator=g, dtype=torch.float64) * 100
    cos, sin = angles.cos(), angles.sin()
    a, b = x.double()[..., :half], x.double()[..., half:]
    c, s = cos[:, None], sin[:, None]
    want = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    untouched = qkv[:, heads * dim :].clone()
    elementwise.rope_(x, cos.float(), sin.float())
    torch.testing.assert_close(x.double(), want, **TOL)
    assert torch.equal(qkv[:, heads * dim :], untouched)


def test_layers_match_pytorch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """RMSNorm (with and without the residual) and in-place rope give PyTorch's
    results: the layers take the kernels, and CTXPAR_KERNELS=0 takes PyTorch."""
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=g)
    x, res = torch.randn(70, 576, generator=g), torch.randn(70, 576, generator=g)
    qk = torch.randn(70, 12, 64, generator=g)
    angles = torch.rand(70, 32, generator=g) * 50

    def run() -> list[torch.Tensor]:
        r = res.clone()
        return [norm(x), norm(x, residual=r), r, apply_rotary_(qk.clone(), angles.cos(), angles.sin())]

    calls = []
    real = elementwise.rms_norm, elementwise.rope_
    monkeypatch.setattr(elementwise, "rms_norm", lambda *a: calls.append("norm") or real[0](*a))
    monkeypatch.setattr(elementwise, "rope_", lambda *a: calls.append("rope") or real[1](*a))
    with_kernels = run()
    assert calls == ["norm", "norm", "rope"]
    monkeypatch.setenv("CTXPAR_KERNELS", "0")
    without = run()
    assert len(calls) == 3
    for got, want in zip(with_kernels, without):
        torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(without[3], apply_rotary(qk, angles.cos(), angles.sin()), **TOL)
