"""The Walsh-Hadamard turn of a quantized KV cache's heads (ctxpar/layers/kv_rotation.py):
the kernel and the PyTorch path give the same bits, both are Sylvester's matrix times
the scale (against float64), the two scales undo each other, and attention over a
quantized cache with the turn is closer to float64 attention than without it when
keys and queries share a large channel (what real keys look like)."""

from __future__ import annotations

import pytest
import torch

from ctxpar.kernels import elementwise
from ctxpar.layers import kv_rotation
from ctxpar.layers.attention.attend import GQA, _attend, attend
from ctxpar.layers.kv_quant import KVQuant, default_runs
from ctxpar.worker.kv_cache_allocation import allocate_kv_caches
from helpers.attention_reference import reference
from helpers.reference import single_sequence_context


def sylvester(d: int) -> torch.Tensor:
    """Sylvester's Walsh-Hadamard matrix (d, d) in float64, built by its definition."""
    f = torch.ones(1, 1, dtype=torch.float64)
    while f.shape[0] < d:
        f = torch.cat([torch.cat([f, f], 1), torch.cat([f, -f], 1)], 0)
    return f


@pytest.mark.parametrize("dim", [2, 8, 64, 128])
def test_kernel_and_pytorch_give_the_same_bits_and_sylvesters_product(dim: int) -> None:
    assert elementwise.usable(torch.empty(1))
    x = torch.randn(5, 7, 3, dim, generator=torch.Generator().manual_seed(dim))[:, ::2]  # strided tokens
    q_scale, kv_scale = kv_rotation.scales(dim)
    assert q_scale * kv_scale * dim == 1.0
    got = kv_rotation.turn(x, kv_scale)
    pytorch = kv_rotation._turn_torch(x.reshape(-1, dim).clone(), kv_scale).view(x.shape)
    assert torch.equal(got, pytorch)
    want = (x.double() @ sylvester(dim)) * kv_scale  # F is symmetric: row vectors times F
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    back = kv_rotation.turn(got, q_scale)  # F F = d I: the two scales undo the turn
    torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)


def test_a_projections_views_turn_in_place_and_nothing_else_moves() -> None:
    """q and K|V as attention gets them, views of one (n, [q | k | v]) projection output:
    each turned where it lies (the same bits as the turn of a copy), the rest of the buffer
    as it was; a view whose heads are not one run after another, and a bf16 one, are left as they
    are and a new tensor comes back."""
    n, heads, kv_heads, dim = 6, 4, 2, 64
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(1))
    before = qkv.clone()
    q, entries = qkv[:, : heads * dim].view(n, heads, dim), qkv[:, heads * dim :].view(n, 2, kv_heads, dim)
    q_scale, kv_scale = kv_rotation.scales(dim)
    want_q, want_kv = kv_rotation.turn(q.clone(), q_scale), kv_rotation.turn(entries.clone(), kv_scale)
    assert kv_rotation.turn(q, q_scale) is q
    assert torch.equal(qkv[:, : heads * dim], want_q.view(n, -1))
    assert torch.equal(qkv[:, heads * dim :], before[:, heads * dim :])
    assert kv_rotation.turn(entries, kv_scale) is entries and torch.equal(entries, want_kv)
    k_alone = before[:, heads * dim :].view(n, 2, kv_heads, dim)[:, :, :1]  # its heads not one run after another
    for x in (k_alone, before.bfloat16()[:, : heads * dim].view(n, heads, dim)):
        kept = x.clone()
        got = kv_rotation.turn(x, kv_scale)
        assert got is not x and torch.equal(x, kept)
        assert torch.equal(got, kv_rotation.turn(x.contiguous(), kv_scale))


def test_only_powers_of_two_turn() -> None:
    assert [d for d in range(1, 130) if kv_rotation.turns(d)] == [2, 4, 8, 16, 32, 64, 128]
    assert GQA(0, 64, 0.125).turns_quantized_heads and not GQA(0, 96, 0.1).turns_quantized_heads


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_turned_heads_attend_closer_to_float64(kv_cache_dtype: str) -> None:
    """One 48-token row over a quantized cache whose keys and queries are large in one
    rope pair (channels c and c + dim/2, turning with the position: what real keys'
    large channels are): attend (heads turned) is closer to float64 attention of the
    unquantized inputs than the same step with the heads stored as they come (_attend).
    (One large channel alone would not show it: a run's largest value is its scale, and
    rounds to itself.)"""
    n, heads, kv_heads, dim = 48, 4, 2, 64
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, heads, dim, generator=g)
    kv = torch.randn(n, 2, kv_heads, dim, generator=g)
    angle = torch.arange(n, dtype=torch.float32) * 0.3
    for c, f in ((5, torch.cos), (5 + dim // 2, torch.sin)):
        kv[:, 0, :, c] += 12 * f(angle)[:, None]
        q[:, :, c] += 8 * f(angle + 1.0)[:, None]
    want, _ = reference(q, kv[:, 0], kv[:, 1], dim**-0.5)
    gqa = GQA(0, dim, dim**-0.5)
    quant = KVQuant.of(kv_cache_dtype, (2, kv_heads, dim), default_runs((2, kv_heads, dim)))
    errors = []
    for step in (attend, _attend):
        caches = allocate_kv_caches(1, n, (2, kv_heads, dim), torch.float32, torch.device("cpu"), quant)
        out = step(q.clone(), kv.clone(), single_sequence_context(caches, 0, n, quant), gqa)  # attend turns them
        errors.append((out.double() - want).pow(2).mean().sqrt().item())
    assert errors[0] < 0.95 * errors[1], errors  # measured: int8 0.61x, fp8_e4m3 0.92x, fp8_e5m2 0.89x
