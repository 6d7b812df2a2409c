"""Attention over a KV cache sharded across the DCP ranks (DESIGN.md §6).

Each rank stores only the KV entries it owns (ctxpar/parallel/dcp.py), so no
rank can attend a row alone. The step runs in three moves per layer:

1. queries: in a split step (some prompt rows cut across ranks) every rank
   all-gathers the queries of the others' tokens, in the same collective as
   the KV entries; otherwise every rank already has every query (replicated
   rows: decodes, short prompts). So every rank holds all T queries.
2. partial attention: every rank attends all T queries over its own shard of
   each row's context, giving (out_k, lse_k) per query and head. A query that
   sees none of the shard's keys gets out_k = 0, lse_k = -inf (never NaN).
3. combine: one all-to-all sends each rank the partials of its own local
   tokens from every rank; it merges them exactly,
   ``L = logsumexp_k lse_k``, ``out = Σ_k exp(lse_k − L) · out_k``.

This is "pass-Q" for split rows (Meta's context parallelism): temporary
memory is the step's queries and partials (order max_num_batched_tokens
tokens), never another rank's context. Every collective here runs once per
layer with shapes fixed by the plan, whatever a rank's shard holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ctxpar.layers.context import ForwardContext, store_kv

# attend(q (L, H, Dq), kv (m, *E), mask (L, m) additive or None) -> (out (L, H, Do), lse (L, H))
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class DCPStep:
    """What the sharded attention of one step needs, the same for every layer.

    Rows here are the plan's global rows: every rank computes every token's
    partial attention over its shard.
    """

    query_idx: torch.Tensor  # (T,) int64: row of each global token in the query space (gathered or local)
    query_start_loc: list[int]  # (R+1,) global token range of each row
    start_pos: list[int]  # (R,) position of each row's first token
    shard_slots: list[torch.Tensor]  # R x (m_r,) int64: cache slots of this rank's keys of the row's context
    shard_pos: list[torch.Tensor]  # R x (m_r,) int64: their positions, increasing
    num_visible: list[int]  # (R,) leading keys of the shard before start_pos: visible to every query
    send_idx: torch.Tensor  # (D*n,) int64: global token of each rank's local token; T on padding
    all_to_all: Callable[[torch.Tensor], torch.Tensor]  # (D, n, ...) -> (D, n, ...)


def attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its log-sum-exp. q (L, H, D), k/v (m, Hk, D) with H a
    multiple of Hk, mask (L, m) additive (0 or -inf) or None.

    Returns out (L, H, Dv) and lse (L, H) in float32; a query whose every key
    is masked gets out 0 and lse -inf.
    """
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, heads, len, D)
    if q.device.type == "cpu" and q.shape[-1] == v.shape[-1]:
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        m = mask.to(q.dtype) if mask is not None else None
        out, lse = flash(qh, kh, vh, 0.0, False, attn_mask=m, scale=scale)[:2]
        out, lse = out[0].transpose(0, 1).float(), lse[0].transpose(0, 1).float()
    else:
        rep = qh.shape[1] // kh.shape[1]
        kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
        s = (qh.float() @ kh.float().transpose(-1, -2)) * scale  # (1, H, L, m)
        if mask is not None:
            s = s + mask.float()
        lse = torch.logsumexp(s, -1)  # (1, H, L)
        p = torch.exp(s - torch.where(lse.isfinite(), lse, 0).unsqueeze(-1))
        out, lse = (p @ vh.float())[0].transpose(0, 1), lse[0].transpose(0, 1)
    if mask is not None:
        # The CPU kernel reports lse 0 for a fully masked query: it saw no key at all.
        blind = ~(mask == 0).any(-1)  # (L,)
        out[blind], lse[blind] = 0.0, float("-inf")
    return out, lse


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of attention over disjoint key sets. outs (K, ..., D),
    lses (K, ...) float32 -> (..., D), (...). Parts with lse -inf weigh
    nothing; if all do, out is 0 and lse -inf (no NaN)."""
    top = lses.amax(0)
    top = torch.where(top.isfinite(), top, 0.0)
    w = torch.exp(lses - top)  # (K, ...): exp(-inf) = 0
    total = w.sum(0)
    out = (outs * w.unsqueeze(-1)).sum(0) / total.clamp_min(torch.finfo(total.dtype).tiny).unsqueeze(-1)
    return out, top + torch.log(total)


def sharded_attention(
    q: torch.Tensor, entries: torch.Tensor, ctx: ForwardContext, layer_idx: int, attend: Attend, out_dim: int
) -> torch.Tensor:
    """Write this rank's share of the layer's KV entries, attend over the
    sharded cache and combine across ranks.

    q: (n, H, Dq) local queries; entries: (n, *E) local KV-cache inputs;
    returns (n, H, out_dim) attention outputs of the local tokens (0 on padding).
    """
    step = ctx.dcp
    n, heads = q.shape[0], q.shape[1]
    if ctx.gather is not None:  # split step: one all-gather carries KV entries and queries
        e_shape, q_shape = entries.shape[1:], q.shape[1:]
        both = ctx.gather(torch.cat([entries.reshape(n, -1), q.reshape(n, -1).to(entries.dtype)], dim=1))
        e_width = entries[0].numel()
        entries = both[:, :e_width].reshape(-1, *e_shape)
        q = both[:, e_width:].reshape(-1, *q_shape).to(q.dtype)
    cache = store_kv(entries, ctx, layer_idx)
    qg = q.index_select(0, step.query_idx)  # (T, H, Dq): every token of the step
    T = qg.shape[0]
    # Row T stays empty (out 0, lse -inf): the partial sent for padding tokens.
    partial = torch.zeros(T + 1, heads, out_dim + 1, dtype=torch.float32, device=q.device)
    partial[:, :, out_dim] = float("-inf")
    qsl = step.query_start_loc
    for r in range(len(step.start_pos)):
        a, b = qsl[r], qsl[r + 1]
        out, lse = _row_partial(qg[a:b], cache, step, r, attend)
        if out is not None:
            partial[a:b, :, :out_dim], partial[a:b, :, out_dim] = out, lse
    D = len(step.send_idx) // n
    received = step.all_to_all(partial.index_select(0, step.send_idx).view(D, n, heads, out_dim + 1))
    out, _ = merge_partials(received[..., :out_dim], received[..., out_dim])
    return out.to(q.dtype)


def _row_partial(
    q: torch.Tensor, cache: torch.Tensor, step: DCPStep, r: int, attend: Attend
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(out, lse) of one row's queries over this rank's shard of its context;
    (None, None) when the shard holds none of it."""
    slots, pos, visible = step.shard_slots[r], step.shard_pos[r], step.num_visible[r]
    if len(slots) == 0:
        return None, None
    kv = cache.index_select(0, slots).to(q.dtype)
    parts = []
    if visible > 0:  # keys before the row's first query: no mask
        parts.append(attend(q, kv[:visible], None))
    if visible < len(slots):  # this step's own keys on the shard: causal by position
        q_pos = step.start_pos[r] + torch.arange(q.shape[0], device=q.device)
        allowed = pos[visible:].unsqueeze(0) <= q_pos.unsqueeze(1)  # (L, m_new)
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
        parts.append(attend(q, kv[visible:], mask))
    if len(parts) == 1:
        return parts[0]
    return merge_partials(torch.stack([parts[0][0], parts[1][0]]), torch.stack([parts[0][1], parts[1][1]]))
