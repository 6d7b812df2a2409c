"""Attention kernels in plain PyTorch ops, shaped for the CPU: every function
returns ``(out, lse)`` so partial results over disjoint key sets can be merged
exactly (chunked context, DCP shards).

- ``decode_attention``: every one-query row of a step in one batched call.
  Grouped-query heads are a view (queries of one KV head form the rows of one
  small GEMM), K/V are never expanded, padding keys are masked.
- ``gather_paged_kv``: one index_select that reads the rows' contexts out of a
  paged GQA cache straight into the head-major layout the GEMMs want.
- ``blocked_causal_attention``: prefill. Query blocks against key blocks as
  large GEMMs with an online softmax; key blocks entirely in a query block's
  future are never computed. Bottom-right causal, so a continued prefill
  (queries after cached context) needs no mask over the context.

The straightforward references these are tested against are
``scaled_dot_product_attention`` per row (tests/test_attention_ops.py).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per row over that row's keys.

    q: (B, H, D); k: (B, Hk, S, D); v: (B, Hk, S, Dv), H a multiple of Hk
    (grouped-query: query head i uses KV head i // (H / Hk)). Row b attends to
    keys [0, lengths[b]); the rest of S is padding (None: no padding).
    Returns out (B, H, Dv) and the natural-log sum of exp scores lse (B, H);
    a row with no keys gets out = 0 and lse = -inf.
    """
    B, H, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    g = H // Hk
    scores = torch.matmul((q * scale).view(B, Hk, g, D), k.transpose(-1, -2))  # (B, Hk, g, S)
    if lengths is not None:
        pad = torch.arange(S, device=q.device)[None, :] >= lengths[:, None]  # (B, S)
        scores.masked_fill_(pad[:, None, None, :], NEG_INF)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (B, Hk, g, 1)
    probs = torch.exp(scores.sub_(lse.nan_to_num(neginf=0.0)))  # an empty row: exp(-inf) = 0, not NaN
    out = torch.matmul(probs, v)  # (B, Hk, g, Dv)
    return out.view(B, H, v.shape[-1]), lse.view(B, H)


def padded_slot_table(context_slots: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' cache slots as one (B, S_max) table; a short row repeats its last
    slot (a real, written entry, so padding reads finite values that the mask
    then drops). Returns the table and the lengths (B,)."""
    device = context_slots[0].device
    lengths = torch.tensor([len(s) for s in context_slots], dtype=torch.int64, device=device)
    flat = torch.cat(context_slots)
    starts = torch.cumsum(lengths, 0) - lengths
    cols = torch.arange(int(lengths.max()), device=device)
    idx = starts[:, None] + torch.minimum(cols[None, :], lengths[:, None] - 1)
    return flat[idx], lengths


def gather_paged_kv(cache: torch.Tensor, slot_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a paged GQA cache (num_slots, 2, Hk, D) at slots (B, S), as
    contiguous (B, Hk, S, D) each: one index_select over (slot, K/V head) rows,
    ordered K-or-V first so that each half is contiguous and the batched GEMMs
    fold (B, Hk) into one batch dimension without another copy."""
    _, two, Hk, D = cache.shape
    B, S = slot_table.shape
    heads = torch.arange(two * Hk, device=cache.device).view(two, 1, Hk, 1)
    rows = (slot_table.view(1, B, 1, S) * (two * Hk) + heads).view(-1)  # (2 * B * Hk * S,)
    kv = cache.view(-1, D).index_select(0, rows).view(two, B, Hk, S, D)
    return kv[0], kv[1]


def blocked_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, block_q: int = 256, block_k: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of L queries that are the last L positions of S keys.

    q: (H, L, D); k: (Hk, S, D); v: (Hk, S, Dv), H a multiple of Hk.
    Query i (absolute position S - L + i) sees keys [0, S - L + i].
    Returns out (H, L, Dv), lse (H, L).

    Per query block, the keys before the block's first position need no mask
    and run as GEMMs of block_k keys each with an online softmax (running max,
    rescaled sum and output); only the block-diagonal part is masked. Key
    blocks after a query block's last position are never touched.
    """
    H, L, D = q.shape
    Hk, S, Dv = k.shape[0], k.shape[1], v.shape[-1]
    g = H // Hk
    c = S - L  # cached context before the first query
    qg = (q * scale).view(Hk, g, L, D)
    out = q.new_empty(Hk, g, L, Dv)
    lse = q.new_empty(Hk, g, L)
    kt = k.transpose(1, 2)  # (Hk, D, S)
    for a in range(0, L, block_q):
        b = min(a + block_q, L)
        qb = qg[:, :, a:b].reshape(Hk, g * (b - a), D)  # (Hk, g*lq, D)
        last = c + b  # keys [0, last) are visible to some query of the block
        m = acc = denom = None
        for ks in range(0, last, block_k):
            ke = min(ks + block_k, last)
            s = torch.bmm(qb, kt[:, :, ks:ke])  # (Hk, g*lq, lk)
            if ke > c + a + 1:  # the block reaches past the first query's own position: mask the future
                qpos = c + torch.arange(a, b, device=q.device)
                future = torch.arange(ks, ke, device=q.device)[None, :] > qpos[:, None]  # (lq, lk)
                s.view(Hk, g, b - a, ke - ks).masked_fill_(future, NEG_INF)
            bm = s.amax(-1, keepdim=True)  # (Hk, g*lq, 1); every query sees key 0, so finite
            if m is None:
                m = bm
                p = torch.exp(s.sub_(m))
                denom = p.sum(-1, keepdim=True)
                acc = torch.bmm(p, v[:, ks:ke])
            else:
                m_new = torch.maximum(m, bm)
                alpha = torch.exp(m - m_new)
                p = torch.exp(s.sub_(m_new))
                denom = denom.mul_(alpha).add_(p.sum(-1, keepdim=True))
                acc = acc.mul_(alpha).baddbmm_(p, v[:, ks:ke])
                m = m_new
        out[:, :, a:b] = (acc / denom).view(Hk, g, b - a, Dv)
        lse[:, :, a:b] = (m + torch.log(denom)).view(Hk, g, b - a)
    return out.view(H, L, Dv), lse.view(H, L)
