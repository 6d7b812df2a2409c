"""The attention entry that models call: ``attend(q, entries, ctx, kind)``.

A model's attention layer projects, normalises and ropes its queries and its
KV-cache entries, hands both here, and projects the output:

    project -> norm -> rope -> attend -> project

``attend`` owns everything about where the keys live: with a full KV cache on
every rank it all-gathers the step's entries over the PCP ranks (a split
step), writes them into the paged cache and attends each local row over its
context there; with the cache sharded by DCP it goes through
``sharded_attention``. What differs between attention kinds (GQA's K/V heads,
MLA's latents) is an ``AttentionKind``: ``GQA`` below, ``MLAttention`` in
ctxpar/layers/mla.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ctxpar.kernels import attention_kernels as attn_kernels
from ctxpar.layers import kv_rotation
from ctxpar.layers.attention_math import attention_lse, paged_kernel
from ctxpar.layers.forward_context import ForwardContext, gather_and_store_kv
from ctxpar.layers.kv_quant import KVQuant
from ctxpar.layers.paged_attention import gqa_paged_attention
from ctxpar.layers.sharded_attention import sharded_attention

Partials = tuple[torch.Tensor, torch.Tensor]  # out (L, H, out_dim), lse (L, H), float32


class AttentionKind(Protocol):
    """How one attention layer attends, over a full paged cache or over shards."""

    @property
    def layer_idx(self) -> int:
        """Which of ForwardContext.kv_caches is this layer's."""
        ...

    @property
    def turns_quantized_heads(self) -> bool:
        """Whether a quantized cache holds this kind's heads turned (kv_rotation.py)."""
        ...

    @property
    def out_dim(self) -> int:
        """Output width per query head."""
        ...

    def attend_cache(self, q: torch.Tensor, cache: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Local rows' queries (n, H, Dq) over a full cache that holds this
        step's entries -> (n, H, out_dim); padding tokens get zeros."""
        ...

    def shard_query(self, q: torch.Tensor) -> torch.Tensor:
        """The queries as the sharded path attends them (MLA: in latent space)."""
        ...

    def attend_lse(self, q: torch.Tensor, kv: torch.Tensor, counts: torch.Tensor, quant: KVQuant | None) -> Partials:
        """Queries (L, H, Dq), query i over the first counts[i] KV entries of (m, *E), or
        of cache rows of the quantized format ``quant``: ctxpar.layers.sharded_attention.Attend."""
        ...

    def decode_lse(
        self, q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, quant: KVQuant | None
    ) -> Partials | None:
        """One-query rows over their shards in one kernel call, or None where the
        kernel cannot read this cache: ctxpar.layers.sharded_attention.Decode."""
        ...


def attend(q: torch.Tensor, entries: torch.Tensor, ctx: ForwardContext, kind: AttentionKind) -> torch.Tensor:
    """q: (n, H, Dq) local queries; entries: (n, *E) local KV-cache inputs ->
    (n, H, out_dim) attention output of the local tokens (0 on padding). A quantized
    cache of a kind that turns its heads stores them turned (ctxpar/layers/kv_rotation.py)."""
    if ctx.kv_quant is None or not kind.turns_quantized_heads:
        return _attend(q, entries, ctx, kind)
    q_scale, kv_scale = kv_rotation.scales(q.shape[-1])
    out = _attend(kv_rotation.turn(q, q_scale), kv_rotation.turn(entries, kv_scale), ctx, kind)
    return kv_rotation.turn(out, q_scale)


def _attend(q: torch.Tensor, entries: torch.Tensor, ctx: ForwardContext, kind: AttentionKind) -> torch.Tensor:
    if ctx.dcp is not None:  # KV sharded over the ranks
        q = kind.shard_query(q)
        return sharded_attention(q, entries, ctx, kind.layer_idx, kind.attend_lse, kind.out_dim, kind.decode_lse)
    cache = gather_and_store_kv(entries, ctx, kind.layer_idx)  # (num_slots, *E)
    return kind.attend_cache(q, cache, ctx)


@dataclass(frozen=True)
class GQA:
    """Grouped-query attention: entries (n, 2, kv_heads, head_dim), K then V."""

    layer_idx: int
    head_dim: int
    scale: float

    @property
    def out_dim(self) -> int:
        return self.head_dim

    @property
    def turns_quantized_heads(self) -> bool:
        return kv_rotation.turns(self.head_dim)

    def attend_cache(self, q: torch.Tensor, cache: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return gqa_paged_attention(q, cache, ctx, self.scale)

    def shard_query(self, q: torch.Tensor) -> torch.Tensor:
        return q

    def attend_lse(self, q: torch.Tensor, kv: torch.Tensor, counts: torch.Tensor, quant: KVQuant | None) -> Partials:
        if quant is not None:
            if attn_kernels.prefill_quant_usable(q, quant):  # the rows read in place
                return attn_kernels.prefill_attention_quant(q, kv, quant, self.scale, counts=counts)
            kv = quant.dequantize(kv).to(q.dtype)
        return attention_lse(q, kv[:, 0], kv[:, 1], self.scale, counts)

    def decode_lse(
        self, q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, quant: KVQuant | None
    ) -> Partials | None:
        if not paged_kernel(cache, self.head_dim):
            return None
        return attn_kernels.gqa_paged_decode(q, cache, slots, starts, self.scale, quant)
