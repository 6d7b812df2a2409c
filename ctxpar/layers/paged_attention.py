"""Attention of a step's local rows over the paged KV cache, dispatched by row kind.

One-query rows (decodes, and one-token prompt suffixes) see every key of
their context, so the order of the keys does not matter and a row's context
can be split into parts whose ``(out, lse)`` merge exactly
(``merge_attention``):

- **Runs read in place**: each maximal range of consecutive cache slots of at
  least ``MIN_RUN`` keys (the allocator keeps a request's blocks adjacent
  where it can, ctxpar/engine/block_manager.py) is attended as a view of the
  cache: no copy. Decode is memory-bound, and the copy read and wrote the
  whole context once more per row per layer.
- **The rest, gathered and batched**: short rows whole, and long rows' slots
  outside long runs, run together in batched ``decode_attention`` calls over
  one gather each. Entries of similar length share a call (sorted by length,
  a group closes before padding would exceed ``MAX_PADDING`` of its keys):
  reading padding costs as much as reading keys.

Long one-query rows without any long run (a fragmented cache) and rows of
several queries (prefill chunks) attend one by one with ``causal_attention``
over one ``index_select`` of their context: there the gather dominates, and
one index_select of whole slots per row (then PyTorch's kernel) beats the
batched call's gather of per-head rows.

The index tensors of the decode batch are the same for every layer of a step,
so they are built once and kept in ``ForwardContext.memo``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ctxpar.layers.attention_ops import decode_attention, gather_paged_kv, padded_slot_table
from ctxpar.layers.context import ForwardContext, causal_attention, merge_attention

MAX_PADDING = 0.25  # padded keys a decode group may add, as a share of its real keys
# Longer one-query rows without a long run attend one by one. Measured per
# 30-layer step, SmolLM2 shapes, 1 thread: 16 rows of 80 keys 17 vs 24 ms
# (batched wins), 64 rows of 40-150 keys 112 vs 113 ms, 16 rows of 256 keys
# 68 vs 52 ms, 1 row of 2048 29 vs 31 ms.
DECODE_BATCH_MAX_KEYS = 128
MIN_RUN = 128  # shortest run of consecutive slots read in place (docs/benchmarks.md)

# (slot table (B, S)) -> K, V (B, Hk, S, *) gathered; (first slot, end slot) -> K, V (1, Hk, n, *) views
GatherKV = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
ViewKV = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class DecodeGroup:
    queries: torch.Tensor  # (B,) int64 index into DecodeBatch.tokens of each entry's query
    slot_table: torch.Tensor  # (B, S_max) int64 cache slots, short entries padded with their last slot
    lengths: torch.Tensor | None  # (B,) keys per entry; None when every entry has S_max


@dataclass
class DecodeBatch:
    rows: set[int]  # local row numbers of the one-query rows attended here
    tokens: torch.Tensor  # (R,) int64 local token index of each such row's query
    groups: list[DecodeGroup]  # gathered entries (whole short rows, long rows' leftovers)
    runs: list[tuple[int, int, int]]  # (query index, first slot, end slot) of each run read in place
    # (K, R) int64: the parts of query i are rows parts[:, i] of the step's parts (the
    # groups' entries in order, then the runs, then one empty part as filler).
    parts: torch.Tensor


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


def split_runs(slots: torch.Tensor) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """A row's context slots as its maximal runs of at least MIN_RUN consecutive
    slots, [(first, end)], and the remaining slots (in ascending order)."""
    s, _ = torch.sort(slots)
    breaks = torch.nonzero(s[1:] - s[:-1] != 1).flatten() + 1
    bounds = [0, *breaks.tolist(), len(s)]
    runs, rest = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b - a >= MIN_RUN:
            runs.append((int(s[a]), int(s[a]) + b - a))
        else:
            rest.append(s[a:b])
    return runs, torch.cat(rest) if rest else s[:0]


def decode_batch(ctx: ForwardContext) -> DecodeBatch | None:
    """The step's one-query rows that attend here (all but long rows without a
    long run), split into runs and gathered entries, or None if there are
    none (memoised per step)."""
    if "decode" not in ctx.memo:
        qsl = ctx.query_start_loc
        rows, runs, entries = [], [], []  # entries: (query index, slots) to gather
        for r in range(ctx.num_rows):
            if qsl[r + 1] - qsl[r] != 1:
                continue
            slots = ctx.context_slots[r]
            row_runs, rest = split_runs(slots) if len(slots) >= MIN_RUN else ([], slots)
            if not row_runs and len(slots) > DECODE_BATCH_MAX_KEYS:
                continue
            i = len(rows)
            rows.append(r)
            runs += [(i, a, b) for a, b in row_runs]
            if len(rest):
                entries.append((i, rest))
        ctx.memo["decode"] = _build_batch(ctx, rows, runs, entries) if rows else None
    return ctx.memo["decode"]


def _build_batch(
    ctx: ForwardContext, rows: list[int], runs: list[tuple[int, int, int]], entries: list[tuple[int, torch.Tensor]]
) -> DecodeBatch:
    device = ctx.context_slots[rows[0]].device
    groups, owner = [], []  # owner: query index of each part, in the parts' order
    for members in _group_by_length([len(s) for _, s in entries]):
        queries = [entries[m][0] for m in members]
        table, lengths = padded_slot_table([entries[m][1] for m in members])
        ragged = bool((lengths != table.shape[1]).any())
        groups.append(DecodeGroup(torch.tensor(queries, device=device), table, lengths if ragged else None))
        owner += queries
    owner += [i for i, _, _ in runs]
    per_query: list[list[int]] = [[] for _ in rows]
    for p, i in enumerate(owner):
        per_query[i].append(p)
    k = max(len(ps) for ps in per_query)
    parts = [[ps[j] if j < len(ps) else len(owner) for ps in per_query] for j in range(k)]
    tokens = torch.tensor([ctx.query_start_loc[r] for r in rows], dtype=torch.int64, device=device)
    return DecodeBatch(set(rows), tokens, groups, runs, torch.tensor(parts, dtype=torch.int64, device=device))


def one_query_attention(
    q: torch.Tensor, dec: DecodeBatch, gather_kv: GatherKV, view_kv: ViewKV, scale: float
) -> torch.Tensor:
    """q (R, H, E) the queries of dec.tokens -> out (R, H, Dv): each over its
    runs (views of the cache) and its gathered entries, merged exactly."""
    outs, lses = [], []
    for grp in dec.groups:
        k, v = gather_kv(grp.slot_table)
        o, lse = decode_attention(q.index_select(0, grp.queries), k, v, grp.lengths, scale)
        outs.append(o)
        lses.append(lse)
    for i, a, b in dec.runs:
        k, v = view_kv(a, b)
        o, lse = decode_attention(q[i : i + 1], k, v, None, scale)
        outs.append(o)
        lses.append(lse)
    out, lse = torch.cat(outs), torch.cat(lses)  # (P, H, Dv), (P, H)
    K, R = dec.parts.shape
    if K == 1:  # one part per query: nothing to merge, the filler is never used
        return out.index_select(0, dec.parts[0])
    out = torch.cat([out, out.new_zeros(1, *out.shape[1:])])
    lse = torch.cat([lse, lse.new_full((1, lse.shape[1]), float("-inf"))])
    flat = dec.parts.view(-1)
    merged, _ = merge_attention(out.index_select(0, flat).view(K, R, *out.shape[1:]), lse.index_select(0, flat).view(K, R, -1))
    return merged.to(q.dtype)


def gqa_paged_attention(q: torch.Tensor, cache: torch.Tensor, ctx: ForwardContext, scale: float) -> torch.Tensor:
    """q (n, H, D) of the local tokens, cache (num_slots, 2, Hk, D) already
    holding this step's entries -> attention output (n, H, D); padding tokens
    (after the last row) get zeros."""
    n = q.shape[0]
    out = q.new_zeros(n, q.shape[1], q.shape[2])
    dec = decode_batch(ctx)
    if dec is not None:

        def view_kv(a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
            kv = cache[a:b].permute(1, 2, 0, 3).unsqueeze(1)  # (2, 1, Hk, n, D), a view
            return kv[0], kv[1]

        o = one_query_attention(q.index_select(0, dec.tokens), dec, lambda t: gather_paged_kv(cache, t), view_kv, scale)
        out.index_copy_(0, dec.tokens, o)
    qsl = ctx.query_start_loc
    done = dec.rows if dec is not None else set()
    for r in range(ctx.num_rows):
        a, b = qsl[r], qsl[r + 1]
        if b - a < 1 or r in done:
            continue
        kv = cache.index_select(0, ctx.context_slots[r])  # (S, 2, Hk, D)
        out[a:b] = causal_attention(q[a:b], kv[:, 0], kv[:, 1], scale)
    return out


def latent_decode_attention(
    q: torch.Tensor, cache: torch.Tensor, dec: DecodeBatch, value_dim: int, scale: float
) -> torch.Tensor:
    """MLA decode in latent space: q (R, H, E) of dec.tokens against cached
    entries (num_slots, E) that serve as the single shared key, whose first
    value_dim values are the value. Returns (R, H, value_dim)."""

    def gather_kv(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, S = table.shape
        k = cache.index_select(0, table.view(-1)).view(B, 1, S, cache.shape[-1]).to(q.dtype)
        return k, k[..., :value_dim]

    def view_kv(a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = cache[a:b].to(q.dtype)[None, None]  # (1, 1, n, E): a view unless the dtypes differ
        return k, k[..., :value_dim]

    return one_query_attention(q, dec, gather_kv, view_kv, scale)
