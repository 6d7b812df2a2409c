"""Attention in plain PyTorch ops: the path of every device without ctxpar's
kernels (a GPU, ``CTXPAR_KERNELS=0``, no compiler), and of the shapes the
kernels do not take. Every function that attends returns what merging needs:

- ``causal``: queries that are the last L of S keys (prefill chunks,
  bottom-right causal);
- ``attention_lse``: attention with its log-sum-exp, each query over its own
  range of the keys (DCP's partials; a sliding window's);
- ``decode_attention``: every one-query row of a step in one batched call.
  Grouped-query heads are a view (queries of one KV head form the rows of one
  small GEMM), K/V are never expanded, padding keys are masked;
- ``merge_attention``: the exact merge of partials over disjoint key sets;
- ``gather_paged_kv``: one index_select that reads the rows' contexts out of a
  paged GQA cache straight into the head-major layout the GEMMs want.

The straightforward references these are tested against are
``scaled_dot_product_attention`` per row (tests/layers/test_attention_ops.py).
PyTorch's kernels choose their blocking by shape, so here a token's bits may
depend on its company; ctxpar's kernels (backend.py) give it the same bits.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

NEG_INF = float("-inf")
# Scores ``attention_lse`` holds at once: queries are taken in blocks of about this
# many (query, head, key) scores.
SCORES_PER_BLOCK = 1 << 24


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of L queries (L, H, D) that are the last L of S keys (S, Hk, D), values
    (S, Hk, D): query i (position S - L + i) sees keys [0, S - L + i]. Returns (L, H, D)
    in q's dtype. PyTorch's ``is_causal`` aligns top-left, so a continued prefill
    (0 < S - L, L > 1) on the CPU is split into a mask-free part over the old context
    and a causal part over the new keys, merged by their log-sum-exp: faster than an
    explicit mask. Off the CPU ``lower_right_sdpa`` masks natively."""
    L, S = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    if L == S or L == 1:
        out = torch.nn.functional.scaled_dot_product_attention(
            qh, kh, vh, is_causal=L > 1, scale=scale, enable_gqa=kh.shape[1] != qh.shape[1]
        )
        return out[0].transpose(0, 1)
    if q.device.type != "cpu":
        return lower_right_sdpa(qh, kh, vh, scale)[0].transpose(0, 1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, _ = bottom_right_causal(  # (1, H, L, D)
        L, S, lambda keys, causal: flash(qh, kh[:, :, keys], vh[:, :, keys], 0.0, causal, scale=scale)[:2]
    )
    return out[0].transpose(0, 1).to(q.dtype)


def lower_right_sdpa(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, scale: float) -> torch.Tensor:
    """PyTorch's SDPA of queries (B, H, L, D) that are the last L of S keys (B, Hk, S, D),
    causal aligned bottom-right: the path off the CPU, where the flash and
    memory-efficient kernels mask so natively (elsewhere, e.g. fp32 with GQA, the mask
    is materialized). It also runs on the CPU, where its tests run."""
    from torch.nn.attention.bias import causal_lower_right

    L, S = qh.shape[-2], kh.shape[-2]
    return torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=causal_lower_right(L, S), scale=scale, enable_gqa=kh.shape[1] != qh.shape[1]
    )


def bottom_right_causal(
    L: int, S: int, attend: Callable[[slice, bool], tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of queries that are the last L of S keys, aligned
    bottom-right, from ``attend(keys, causal) -> (out, lse)`` over a slice of
    the keys whose ``causal`` aligns top-left: an unmasked part over the first
    S - L keys and a causal square over the last L, merged exactly."""
    if L == S:
        return attend(slice(0, S), True)
    early, square = attend(slice(0, S - L), False), attend(slice(S - L, S), True)
    return merge_attention(torch.stack([early[0], square[0]]), torch.stack([early[1], square[1]]))


def merge_attention(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of attention over K disjoint key sets:
    ``L = logsumexp_k lse_k``, ``out = Σ_k exp(lse_k − L) · out_k``.

    outs (K, ..., D), lses (K, ...) natural-log sums of exp scores -> out
    (..., D) (in the promoted dtype of outs and lses), lse (...). A part with
    lse -inf (no keys) weighs nothing; if all are, out is 0 and lse -inf (no NaN).
    The sums run over k in order, element by element, so an element's result
    depends on its own parts only (DCP merges a query's shards with it).
    """
    top = lses.amax(0)
    top = torch.where(top.isfinite(), top, 0.0)
    w = torch.exp(lses - top)  # (K, ...): exp(-inf) = 0
    total, out = w[0], outs[0] * w[0].unsqueeze(-1)
    for k in range(1, len(w)):
        total, out = total + w[k], out + outs[k] * w[k].unsqueeze(-1)
    return out / total.clamp_min(torch.finfo(total.dtype).tiny).unsqueeze(-1), top + torch.log(total)


def attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    counts: torch.Tensor,
    firsts: torch.Tensor | None = None,
    soft_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its log-sum-exp, each query over a prefix of the keys: q (L, H, D),
    k (m, Hk, D), v (m, Hk, Dv); counts (L,) int64, query i sees keys [0, counts[i]),
    and none before firsts[i] if given (a sliding window); soft_cap: logits x become
    soft_cap · tanh(x / soft_cap). Returns out (L, H, Dv) and lse (L, H), float32 (a
    query left no key: out 0, lse -inf); queries in blocks of about SCORES_PER_BLOCK scores."""
    L, m, rep = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    kh, vh = k.transpose(0, 1).repeat_interleave(rep, 0).float(), v.transpose(0, 1).repeat_interleave(rep, 0).float()
    outs, lses = [], []
    step = max(1, SCORES_PER_BLOCK // max(1, q.shape[1] * m))
    for a in range(0, L, step):
        qh = q[a : a + step].transpose(0, 1).float()  # (H, l, D)
        s = soft_capped((qh @ kh.transpose(-1, -2)) * scale, soft_cap)  # (H, l, m)
        keys = torch.arange(m, device=q.device)
        hidden = keys >= counts[a : a + step, None].to(q.device)  # (l, m)
        if firsts is not None:
            hidden |= keys < firsts[a : a + step, None].to(q.device)
        s = s.masked_fill(hidden, float("-inf"))
        lse = torch.logsumexp(s, -1)  # (H, l)
        outs.append((torch.exp(s - lse.nan_to_num(neginf=0.0).unsqueeze(-1)) @ vh).transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor | None,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per row over that row's keys.

    q: (B, H, D); k: (B, Hk, S, D); v: (B, Hk, S, Dv), H a multiple of Hk
    (grouped-query: query head i uses KV head i // (H / Hk)). Row b attends to
    keys [0, lengths[b]); the rest of S is padding (None: no padding); with a
    window, to the last ``window`` of those only; soft_cap: logits x become
    soft_cap · tanh(x / soft_cap). Returns out (B, H, Dv) and the natural-log sum
    of exp scores lse (B, H); a row with no keys gets out = 0 and lse = -inf.
    """
    B, H, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    g = H // Hk
    scores = torch.matmul((q * scale).view(B, Hk, g, D), k.transpose(-1, -2))  # (B, Hk, g, S)
    if soft_cap is not None:
        scores = soft_capped(scores, soft_cap)
    if lengths is not None or window is not None:
        ends = lengths if lengths is not None else torch.full((B,), S, device=q.device)
        keys = torch.arange(S, device=q.device)[None, :]
        hidden = keys >= ends[:, None]  # (B, S)
        if window is not None:
            hidden |= keys < ends[:, None] - window
        scores.masked_fill_(hidden[:, None, None, :], NEG_INF)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (B, Hk, g, 1)
    probs = torch.exp(scores.sub_(lse.nan_to_num(neginf=0.0)))  # an empty row: exp(-inf) = 0, not NaN
    out = torch.matmul(probs, v)  # (B, Hk, g, Dv)
    return out.view(B, H, v.shape[-1]), lse.view(B, H)


def soft_capped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap · tanh(logits / cap)`` (Gemma 2's attention logits), or the logits (cap None)."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


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
    mask then drops). Returns the table and the lengths (B,); a row without slots is padded
    with one from another row, or slot 0 where none has any."""
    lengths = starts[1:] - starts[:-1]
    if slots.numel() == 0:  # no row has a key (a DCP shard holding none of any row's window)
        return torch.zeros(len(lengths), 1, dtype=slots.dtype, device=slots.device), lengths  # one masked slot
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
