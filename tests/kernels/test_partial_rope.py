"""The rope kernel over part of each head (ctxpar/kernels/elementwise.cpp's rope_partial: a partial
rotary factor's, Phi-4-mini's first 3/4): each head's first rot dims turned in half-split pairs
(k, k + rot/2), as transformers' Phi-3 turns q[..., :rotary_dim], the rest of the head and of the
token's row untouched; against the formula in float64 (fp32) and within half a bf16 unit (bf16), and
``apply_rotary_`` with the kernels against its PyTorch path (CTXPAR_KERNELS=0)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctxpar.kernels import elementwise
from ctxpar.layers.rotary import apply_rotary_

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _case(seed: int, n: int, heads: int, half: int, passed: int, extra: int, dtype: torch.dtype):
    """(row (n, (heads + extra) * dim), its heads (n, heads, dim), cos, sin (n, half), the exact result)."""
    g = torch.Generator().manual_seed(seed)
    dim = 2 * half + passed
    qkv = torch.randn(n, (heads + extra) * dim, generator=g).to(dtype)
    x = qkv[:, : heads * dim].view(n, heads, dim)
    angles = torch.rand(n, half, generator=g) * 100
    cos, sin = angles.cos(), angles.sin()
    a, b, rest = x.double().split([half, half, passed], dim=-1)
    c, s = cos.double()[:, None], sin.double()[:, None]
    return qkv, x, cos, sin, torch.cat([a * c - b * s, b * c + a * s, rest], dim=-1)


@SETTINGS
@given(
    n=st.integers(1, 30),
    heads=st.integers(1, 9),
    half=st.integers(1, 40),
    passed=st.integers(1, 40),
    extra=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_fp32_turns_the_first_rot_dims(march: str, n: int, heads: int, half: int, passed: int, extra: int, seed: int):
    qkv, x, cos, sin, want = _case(seed, n, heads, half, passed, extra, torch.float32)
    beyond = qkv[:, x.shape[1] * x.shape[2] :].clone()
    elementwise.rope_(x, cos, sin)
    torch.testing.assert_close(x.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(x[..., 2 * half :].double(), want[..., 2 * half :])  # passed through, bit for bit
    assert torch.equal(qkv[:, x.shape[1] * x.shape[2] :], beyond)


@SETTINGS
@given(n=st.integers(1, 30), heads=st.integers(1, 9), half=st.integers(1, 40), passed=st.integers(1, 40))
def test_bf16_rounds_once(march: str, n: int, heads: int, half: int, passed: int) -> None:
    _, x, cos, sin, want = _case(n * heads + half, n, heads, half, passed, 0, torch.bfloat16)
    elementwise.rope_(x, cos, sin)
    assert (x.double() - want).abs().le(want.abs() * 2.0**-8 + 1e-6).all()


def test_the_kernel_is_the_pytorch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Phi-4-mini's shape (96 of 128 dims), Q and K heads inside a QKV row: the kernel's results are
    PyTorch's (apply_rotary on the first 96 dims) to float32's rounding, V untouched by both."""
    qkv, x, cos, sin, _ = _case(0, 37, 8 + 2, 48, 32, 2, torch.float32)
    calls = []
    real = elementwise.rope_
    monkeypatch.setattr(elementwise, "rope_", lambda *a: calls.append(1) or real(*a))
    got = qkv.clone()
    apply_rotary_(got[:, : x.numel() // 37].view(x.shape), cos, sin)
    monkeypatch.setenv("CTXPAR_KERNELS", "0")
    want = qkv.clone()
    apply_rotary_(want[:, : x.numel() // 37].view(x.shape), cos, sin)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[..., 96:128], qkv[..., 96:128]) and torch.equal(got[:, -256:], qkv[:, -256:])


def test_tables_wider_than_the_head_are_refused() -> None:
    x = torch.zeros(2, 3, 8)
    with pytest.raises(ValueError, match="rot <= 8"):
        elementwise.rope_(x, torch.zeros(2, 5), torch.zeros(2, 5))
