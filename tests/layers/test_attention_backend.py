"""The attention backend (ctxpar/layers/attention/backend.py): chosen once when a rank's
metadata builder is made, carried in every step's ForwardContext, and the only thing
that decides whether a call runs in ctxpar's kernels or in PyTorch's ops."""

from __future__ import annotations

import pytest
import torch

from ctxpar import kernels
from ctxpar.kernels import attention_kernels as attn_kernels
from ctxpar.layers.attention.backend import KERNELS, TORCH, AttentionSpec
from ctxpar.layers.attention.paged import gqa_paged_attention
from ctxpar.layers.attention_metadata import AttentionMetadataBuilder
from ctxpar.layers.forward_context import ForwardContext

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="needs the compiled kernels")


def _step(backend=None) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
    """A step of one 5-token prompt chunk after 7 cached tokens and two decodes (contexts
    of 9 and 20), over a GQA cache of 4 KV heads of 32: (q, cache, its context)."""
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(64, 2, 4, 32, generator=g)
    seq_lens, tokens = [12, 9, 20], [5, 1, 1]
    slots = [torch.randperm(64, generator=g)[:s] for s in seq_lens]
    ctx = ForwardContext(
        query_start_loc=[0, 5, 6, 7],
        start_pos=[s - t for s, t in zip(seq_lens, tokens)],
        seq_lens=seq_lens,
        context_slots=slots,
        write_src=None,
        write_slots=torch.empty(0, dtype=torch.int64),
        kv_caches=[cache],
        prompt_lens=[12, 4, 4],
        backend=backend,
    )
    return torch.randn(7, 8, 32, generator=g), cache, ctx


@needs_kernels
def test_the_builder_chooses_once_and_the_context_carries_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's builder picks the kernels on the CPU where they are built; a later change of
    CTXPAR_KERNELS does not reach the steps it builds, whose context names its backend."""
    builder = AttentionMetadataBuilder([torch.zeros(4, 2, 1, 8)], None, torch.device("cpu"))
    assert builder.backend is KERNELS
    monkeypatch.setenv("CTXPAR_KERNELS", "0")
    assert AttentionMetadataBuilder([torch.zeros(4, 2, 1, 8)], None, torch.device("cpu")).backend is TORCH
    assert _step(builder.backend)[2].attention is KERNELS
    assert _step()[2].attention is TORCH  # a context built by hand: the device's default, now PyTorch


@needs_kernels
def test_the_context_backend_decides_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same step through each backend: the kernel backend calls the decode and prefill
    kernels, the PyTorch backend none, though the kernels are on; both attend alike."""
    calls: list[str] = []
    for name in ("gqa_paged_decode", "prefill_attention"):
        real = getattr(attn_kernels, name)
        monkeypatch.setattr(attn_kernels, name, lambda *a, _n=name, _r=real, **kw: calls.append(_n) or _r(*a, **kw))
    outs = {}
    for backend in (KERNELS, TORCH):
        calls.clear()
        q, cache, ctx = _step(backend)
        outs[backend.name] = gqa_paged_attention(q, cache, ctx, AttentionSpec(32**-0.5))
        assert (sorted(set(calls)) == ["gqa_paged_decode", "prefill_attention"]) == (backend is KERNELS), calls
    torch.testing.assert_close(outs["kernels"], outs["torch"], atol=1e-5, rtol=1e-5)
