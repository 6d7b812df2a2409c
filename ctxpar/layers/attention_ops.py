"""Attention kernels in plain PyTorch ops, shaped for the CPU: every function
returns ``(out, lse)`` so partial results over disjoint key sets can be merged
exactly (chunked context, DCP shards).

- ``decode_attention``: every one-query row of a step in one batched call.
  Grouped-query heads are a view (queries of one KV head form the rows of one
  small GEMM), K/V are never expanded, padding keys are masked.
- ``gather_paged_kv``: one index_select that reads the rows' contexts out of a
  paged GQA cache straight into the head-major layout the GEMMs want.

The straightforward references these are tested against are
``scaled_dot_product_attention`` per row (tests/layers/test_attention_ops.py).
"""

from __future__ import annotations

import itertools

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


def concat_slots(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' cache slots back to back, and where each row's start: (N,) and
    (B + 1,) int64, row b's at [starts[b], starts[b+1]) (the compiled kernels'
    and ``padded_slot_table``'s input)."""
    starts = list(itertools.accumulate((len(s) for s in rows), initial=0))
    return torch.cat(rows), torch.tensor(starts, dtype=torch.int64, device=rows[0].device)


def padded_slot_table(slots: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' cache slots, back to back in ``slots`` (row b's at
    [starts[b], starts[b+1])), as one (B, S_max) table; a short row repeats its
    last slot (a real, written entry, so padding reads finite values that the
    mask then drops). Returns the table and the lengths (B,). Every row has a slot."""
    lengths = starts[1:] - starts[:-1]
    cols = torch.arange(int(lengths.max()), device=slots.device)
    idx = starts[:-1, None] + torch.minimum(cols[None, :], lengths[:, None] - 1)
    return slots[idx], lengths


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
