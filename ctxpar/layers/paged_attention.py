"""Attention of a step's local rows over the paged KV cache, dispatched by row kind.

- One-query rows (decodes, and one-token prompt suffixes) run together in one
  batched ``decode_attention`` call: their contexts are read out of the cache
  by a single gather into the layout the GEMMs want, instead of one copy and
  one kernel call per row per layer.
- Longer rows (prefill chunks) attend one by one with ``causal_attention``:
  there are few of them and each is a large computation.

The index tensors of the decode batch are the same for every layer of a step,
so they are built once and kept in ``ForwardContext.memo``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctxpar.layers.attention_ops import decode_attention, gather_paged_kv, padded_slot_table
from ctxpar.layers.context import ForwardContext, causal_attention


@dataclass
class DecodeBatch:
    rows: list[int]  # local row numbers of the one-query rows
    tokens: torch.Tensor  # (B,) int64 local token index of each row's query
    slot_table: torch.Tensor  # (B, S_max) int64 cache slots, short rows padded with their last slot
    lengths: torch.Tensor | None  # (B,) keys per row; None when every row has S_max


def decode_batch(ctx: ForwardContext) -> DecodeBatch | None:
    """The step's one-query rows, or None if it has none (memoised per step)."""
    if "decode" not in ctx.memo:
        qsl = ctx.query_start_loc
        rows = [r for r in range(ctx.num_rows) if qsl[r + 1] - qsl[r] == 1]
        batch = None
        if rows:
            device = ctx.context_slots[rows[0]].device
            table, lengths = padded_slot_table([ctx.context_slots[r] for r in rows])
            ragged = bool((lengths != table.shape[1]).any())
            tokens = torch.tensor([qsl[r] for r in rows], dtype=torch.int64, device=device)
            batch = DecodeBatch(rows, tokens, table, lengths if ragged else None)
        ctx.memo["decode"] = batch
    return ctx.memo["decode"]


def gqa_paged_attention(q: torch.Tensor, cache: torch.Tensor, ctx: ForwardContext, scale: float) -> torch.Tensor:
    """q (n, H, D) of the local tokens, cache (num_slots, 2, Hk, D) already
    holding this step's entries -> attention output (n, H, D); padding tokens
    (after the last row) get zeros."""
    n = q.shape[0]
    out = q.new_zeros(n, q.shape[1], q.shape[2])
    dec = decode_batch(ctx)
    if dec is not None:
        k, v = gather_paged_kv(cache, dec.slot_table)  # (B, Hk, S, D) each
        o, _ = decode_attention(q.index_select(0, dec.tokens), k, v, dec.lengths, scale)
        out.index_copy_(0, dec.tokens, o)
    qsl = ctx.query_start_loc
    single = set(dec.rows) if dec is not None else set()
    for r in range(ctx.num_rows):
        a, b = qsl[r], qsl[r + 1]
        if b - a < 1 or r in single:
            continue
        kv = cache.index_select(0, ctx.context_slots[r])  # (S, 2, Hk, D)
        out[a:b] = causal_attention(q[a:b], kv[:, 0], kv[:, 1], scale)
    return out


def latent_decode_attention(
    q: torch.Tensor, cache: torch.Tensor, dec: DecodeBatch, value_dim: int, scale: float
) -> torch.Tensor:
    """MLA decode in latent space for all one-query rows: q (B, H, E) against
    cached entries (num_slots, E) that serve as the single shared key, whose
    first value_dim values are the value. Returns (B, H, value_dim)."""
    B, S = dec.slot_table.shape
    k = cache.index_select(0, dec.slot_table.view(-1)).view(B, 1, S, cache.shape[-1]).to(q.dtype)
    out, _ = decode_attention(q, k, k[..., :value_dim], dec.lengths, scale)
    return out
