"""The attention entry that models call: ``attend(q, entries, ctx, kind)``.

A model's attention layer projects, normalises and ropes its queries and its
KV-cache entries, hands both here, and projects the output:

    project -> norm -> rope -> attend -> project

``attend`` owns everything about where the keys live: with a full KV cache on
every rank it all-gathers the step's entries over the PCP ranks (a split
step), writes them into the paged cache and attends each local row over its
context there (paged.py); with the cache sharded by DCP it goes through
``sharded_attention`` (sharded.py). What differs between attention kinds (GQA's
K/V heads, MLA's latents) is an ``AttentionKind``: ``GQA`` below, ``MLAttention``
in ctxpar/layers/mla.py. How the keys are attended is the step's backend's
(``ctx.attention``, backend.py), the same for every kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch

from ctxpar.layers import kv_rotation
from ctxpar.layers.attention.backend import AttentionBackend, AttentionSpec, DecodeGroup, Partials
from ctxpar.layers.attention.paged import gqa_paged_attention
from ctxpar.layers.attention.sharded import sharded_attention
from ctxpar.layers.forward_context import ForwardContext, gather_and_store_kv
from ctxpar.layers.kv_quant import KVQuant


class AttentionKind(Protocol):
    """How one attention layer attends, over a full paged cache or over shards."""

    @property
    def layer_idx(self) -> int:
        """Which of ForwardContext.kv_caches is this layer's."""
        ...

    @property
    def spec(self) -> AttentionSpec:
        """What the layer's attention computes (its scale, window, soft cap)."""
        ...

    @property
    def turns_quantized_heads(self) -> bool:
        """Whether a quantized cache holds this kind's heads turned (kv_rotation.py)."""
        ...

    @property
    def out_dim(self) -> int:
        """Output width per query head."""
        ...

    @property
    def paged_widths(self) -> tuple[int, ...]:
        """The head widths one-query rows read of the paged cache (``AttentionBackend.reads_paged``)."""
        ...

    def attend_cache(self, q: torch.Tensor, cache: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Local rows' queries (n, H, Dq) over a full cache that holds this
        step's entries -> (n, H, out_dim); padding tokens get zeros."""
        ...

    def shard_query(self, q: torch.Tensor) -> torch.Tensor:
        """The queries as the sharded path attends them (MLA: in latent space)."""
        ...

    def attend_lse(
        self,
        backend: AttentionBackend,
        q: torch.Tensor,
        kv: torch.Tensor,
        counts: torch.Tensor,
        quant: KVQuant | None,
        firsts: torch.Tensor | None = None,
    ) -> Partials:
        """Queries (L, H, Dq), query i over the first counts[i] KV entries of (m, *E) (from
        firsts[i], if given), or of cache rows of the quantized format ``quant``:
        ctxpar.layers.attention.sharded.Attend."""
        ...

    def decode_lse(
        self, backend: AttentionBackend, q: torch.Tensor, cache: torch.Tensor, group: DecodeGroup, quant: KVQuant | None
    ) -> Partials:
        """One-query rows over their shards in one call, where the backend ``reads_paged``
        this cache: ctxpar.layers.attention.sharded.Decode."""
        ...


def attend(q: torch.Tensor, entries: torch.Tensor, ctx: ForwardContext, kind: AttentionKind) -> torch.Tensor:
    """q: (n, H, Dq) local queries; entries: (n, *E) local KV-cache inputs ->
    (n, H, out_dim) attention output of the local tokens (0 on padding). A quantized
    cache of a kind that turns its heads stores them turned (ctxpar/layers/kv_rotation.py):
    q and entries are then turned in place where they lie as the kernel takes them (as rope
    turns them in place before), so they are the caller's to give, not to read again."""
    if ctx.kv_quant is None or not kind.turns_quantized_heads:
        return _attend(q, entries, ctx, kind)
    q_scale, kv_scale = kv_rotation.scales(q.shape[-1])
    out = _attend(kv_rotation.turn(q, q_scale), kv_rotation.turn(entries, kv_scale), ctx, kind)
    return kv_rotation.turn(out, q_scale)


def _attend(q: torch.Tensor, entries: torch.Tensor, ctx: ForwardContext, kind: AttentionKind) -> torch.Tensor:
    if ctx.dcp is not None:  # KV sharded over the ranks
        q = kind.shard_query(q)
        in_place = ctx.attention.reads_paged(ctx.kv_caches[kind.layer_idx], *kind.paged_widths)
        decode = kind.decode_lse if in_place else None
        args = (kind.layer_idx, kind.attend_lse, kind.out_dim, decode, kind.spec.window)
        return sharded_attention(q, entries, ctx, *args)
    cache = gather_and_store_kv(entries, ctx, kind.layer_idx)  # (num_slots, *E)
    return kind.attend_cache(q, cache, ctx)


@dataclass(frozen=True)
class GQA:
    """Grouped-query attention: entries (n, 2, kv_heads, head_dim), K then V. window and
    soft_cap: the layer's variant (``AttentionSpec``); None: neither."""

    layer_idx: int
    head_dim: int
    scale: float
    window: int | None = None
    soft_cap: float | None = None

    @cached_property
    def spec(self) -> AttentionSpec:
        return AttentionSpec(self.scale, self.window, self.soft_cap)

    @property
    def out_dim(self) -> int:
        return self.head_dim

    @property
    def paged_widths(self) -> tuple[int, ...]:
        return (self.head_dim,)

    @property
    def turns_quantized_heads(self) -> bool:
        return kv_rotation.turns(self.head_dim)

    def attend_cache(self, q: torch.Tensor, cache: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return gqa_paged_attention(q, cache, ctx, self.spec)

    def shard_query(self, q: torch.Tensor) -> torch.Tensor:
        return q

    def attend_lse(
        self,
        backend: AttentionBackend,
        q: torch.Tensor,
        kv: torch.Tensor,
        counts: torch.Tensor,
        quant: KVQuant | None,
        firsts: torch.Tensor | None = None,
    ) -> Partials:
        return backend.gqa_partial_rows(q, kv, quant, self.spec, counts, firsts)

    def decode_lse(
        self, backend: AttentionBackend, q: torch.Tensor, cache: torch.Tensor, group: DecodeGroup, quant: KVQuant | None
    ) -> Partials:
        return backend.gqa_decode(q, cache, group, self.spec, quant)
