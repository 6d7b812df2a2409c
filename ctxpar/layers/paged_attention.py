"""Attention of a step's local rows over the paged KV cache, dispatched by row kind.

- Short one-query rows (decodes, and one-token prompt suffixes, of at most
  ``DECODE_BATCH_MAX_KEYS`` keys) run together in batched ``decode_attention``
  calls: their contexts are read out of the cache by one gather per call into
  the layout the GEMMs want, instead of one copy and one kernel call per row
  per layer. Rows of similar context length share
  a call (sorted by length, a group closes before padding would exceed
  ``MAX_PADDING`` of its keys): decode is memory-bound, and reading padding
  costs as much as reading keys.
- Other rows (prefill chunks, long decodes) attend one by one with
  ``causal_attention``: each is a large computation or a large gather.

The index tensors of the decode batch are the same for every layer of a step,
so they are built once and kept in ``ForwardContext.memo``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctxpar.layers.attention_ops import decode_attention, gather_paged_kv, padded_slot_table
from ctxpar.layers.context import ForwardContext, causal_attention


MAX_PADDING = 0.25  # padded keys a decode group may add, as a share of its real keys
# Longer one-query rows attend one by one: there the gather dominates, and one
# index_select of whole slots per row (then PyTorch's kernel) beats the batched
# call's gather of per-head rows. Measured per 30-layer step, SmolLM2 shapes,
# 1 thread: 16 rows of 80 keys 17 vs 24 ms (batched wins), 64 rows of 40-150
# keys 112 vs 113 ms, 16 rows of 256 keys 68 vs 52 ms, 1 row of 2048 29 vs 31 ms.
DECODE_BATCH_MAX_KEYS = 128


@dataclass
class DecodeGroup:
    tokens: torch.Tensor  # (B,) int64 local token index of each row's query
    slot_table: torch.Tensor  # (B, S_max) int64 cache slots, short rows padded with their last slot
    lengths: torch.Tensor | None  # (B,) keys per row; None when every row has S_max


@dataclass
class DecodeBatch:
    rows: set[int]  # local row numbers of all one-query rows
    groups: list[DecodeGroup]


def _group_by_length(lengths: list[int]) -> list[list[int]]:
    """Indices into `lengths`, longest first, cut so no group pads more than MAX_PADDING."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    real = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= (1 + MAX_PADDING) * (real + lengths[i]):
            groups[-1].append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups


def decode_batch(ctx: ForwardContext) -> DecodeBatch | None:
    """The step's one-query rows of at most DECODE_BATCH_MAX_KEYS keys in length
    groups, or None if it has none (memoised per step)."""
    if "decode" not in ctx.memo:
        qsl = ctx.query_start_loc
        rows = [r for r in range(ctx.num_rows) if qsl[r + 1] - qsl[r] == 1 and ctx.seq_lens[r] <= DECODE_BATCH_MAX_KEYS]
        batch = None
        if rows:
            device = ctx.context_slots[rows[0]].device
            groups = []
            for members in _group_by_length([ctx.seq_lens[r] for r in rows]):
                rs = [rows[i] for i in members]
                table, lengths = padded_slot_table([ctx.context_slots[r] for r in rs])
                ragged = bool((lengths != table.shape[1]).any())
                tokens = torch.tensor([qsl[r] for r in rs], dtype=torch.int64, device=device)
                groups.append(DecodeGroup(tokens, table, lengths if ragged else None))
            batch = DecodeBatch(set(rows), groups)
        ctx.memo["decode"] = batch
    return ctx.memo["decode"]


def gqa_paged_attention(q: torch.Tensor, cache: torch.Tensor, ctx: ForwardContext, scale: float) -> torch.Tensor:
    """q (n, H, D) of the local tokens, cache (num_slots, 2, Hk, D) already
    holding this step's entries -> attention output (n, H, D); padding tokens
    (after the last row) get zeros."""
    n = q.shape[0]
    out = q.new_zeros(n, q.shape[1], q.shape[2])
    dec = decode_batch(ctx)
    for grp in dec.groups if dec is not None else []:
        k, v = gather_paged_kv(cache, grp.slot_table)  # (B, Hk, S, D) each
        o, _ = decode_attention(q.index_select(0, grp.tokens), k, v, grp.lengths, scale)
        out.index_copy_(0, grp.tokens, o)
    qsl = ctx.query_start_loc
    single = dec.rows if dec is not None else set()
    for r in range(ctx.num_rows):
        a, b = qsl[r], qsl[r + 1]
        if b - a < 1 or r in single:
            continue
        kv = cache.index_select(0, ctx.context_slots[r])  # (S, 2, Hk, D)
        out[a:b] = causal_attention(q[a:b], kv[:, 0], kv[:, 1], scale)
    return out


def latent_decode_attention(
    q: torch.Tensor, cache: torch.Tensor, grp: DecodeGroup, value_dim: int, scale: float
) -> torch.Tensor:
    """MLA decode in latent space for a group of one-query rows: q (B, H, E)
    against cached entries (num_slots, E) that serve as the single shared key,
    whose first value_dim values are the value. Returns (B, H, value_dim)."""
    B, S = grp.slot_table.shape
    k = cache.index_select(0, grp.slot_table.view(-1)).view(B, 1, S, cache.shape[-1]).to(q.dtype)
    out, _ = decode_attention(q, k, k[..., :value_dim], grp.lengths, scale)
    return out
