"""Attention over a KV cache sharded across the DCP ranks (docs/architecture.md, decode context parallelism).

Each rank stores only the KV entries it owns (ctxpar/parallel/dcp_shard.py), so no
rank can attend a row's cached context alone. A row's keys are its *context*
(positions before this step, in the shards) and its *new* keys (this step's
own tokens, which every rank has in this layer's entries: gathered in a split
step, computed locally when every row is replicated). Per layer:

1. new keys: each rank attends its local rows over their new keys, causally,
   exactly as without DCP (the PCP layout balances this work) -> (out, lse);
2. context, shard by shard (rows with queries on every rank, and split rows
   on the pass-Q path): each rank attends the rows' queries over its shard of
   their context, unmasked (every query sees its whole context); one
   all-to-all then sends each rank the partials of its own local tokens from
   every rank. Split rows' queries reach every rank in the same all-gather
   as the KV entries (pass-Q);
3. context, gathered (split rows on the other path, ctxpar/layers/sharded_context.py):
   each rank all-gathers the rows' context from the shards in bounded rounds
   and attends its own queries over it locally;
4. combine exactly: ``L = logsumexp_k lse_k``, ``out = Σ_k exp(lse_k − L) · out_k``
   over the parts. A shard holding none of a row's context sends lse = -inf,
   which weighs nothing (never NaN).

Which path the split rows take is decided per step from shapes every rank has
(``gathers_context``). Temporary memory is the step's queries and partials, or
one round of gathered context, of the order of max_num_batched_tokens tokens.
Every collective runs once per layer (per round) with shapes fixed by the
plan, whatever a rank's shard holds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ctxpar.layers.attention_math import bottom_right_causal, merge_attention
from ctxpar.layers.attention_ops import concat_slots
from ctxpar.layers.forward_context import (
    DCPStep,
    ForwardContext,
    OneQueryRows,
    StepMemo,
    store_kv,
    to_cache,
)
from ctxpar.layers.kv_quant import KVQuant
from ctxpar.layers.sharded_context import gathered_context_attention, gathers_context

# attend(q (L, H, Dq), kv, causal, quant) -> (out (L, H, Do), lse (L, H)) float32, kv the
# entries (m, *E), or with `quant` their cache rows (m, row_bytes) in that format (read in
# place where a kernel can); causal: L == m and query i sees keys [0, i]; otherwise every
# query sees every key.
Attend = Callable[[torch.Tensor, torch.Tensor, bool, KVQuant | None], tuple[torch.Tensor, torch.Tensor]]
# decode(q (B, H, Dq), cache, slots (N,), starts (B + 1,), quant) -> (out (B, H, Do), lse (B, H))
# float32: one query per row over the cache slots slots[starts[b]:starts[b + 1]] (none:
# out 0, lse -inf), all rows in one call of the compiled kernel; or None where the kernel
# cannot serve this cache (then each row goes through `attend`).
Decode = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, KVQuant | None], tuple[torch.Tensor, torch.Tensor] | None
]


def sharded_attention(
    q: torch.Tensor,
    entries: torch.Tensor,
    ctx: ForwardContext,
    layer_idx: int,
    attend: Attend,
    out_dim: int,
    decode: Decode,
) -> torch.Tensor:
    """Write this rank's share of the layer's KV entries, attend over the
    sharded cache and the step's new keys, and combine across ranks.

    q: (n, H, Dq) local queries; entries: (n, *E) local KV-cache inputs;
    attend, decode: the model's attention over keys, and over the shards of
    one-query rows; returns (n, H, out_dim) attention outputs of the local
    tokens (0 on padding).
    """
    step, split = ctx.dcp, ctx.dcp.split_context
    n, heads = q.shape[0], q.shape[1]
    entries = to_cache(entries, ctx)  # quantized (if so) before any gather: ranks exchange stored bytes
    gather_context = split is not None and gathers_context(
        split.policy, split.context_tokens, q, entries, out_dim, len(step.send_idx), step.replicated_context
    )
    pass_q = split is not None and not gather_context  # the split rows' queries travel
    # Without pass-Q only rows with queries on every rank are attended shard by shard, and
    # such a token's index in the query space (query_idx) is its local index on every rank.
    local_q, q_space = q, q
    if ctx.gather is not None:  # split step: one all-gather carries the KV entries (and the queries)
        e_shape, e_width = entries.shape[1:], entries[0].numel()
        if pass_q:
            # Quantized rows are bytes: the queries travel as their bytes too, exactly.
            as_bytes = ctx.kv_quant is not None
            q_part = q.contiguous().view(torch.uint8) if as_bytes else q.to(entries.dtype)
            both = ctx.gather(torch.cat([entries.reshape(n, -1), q_part.reshape(n, -1)], dim=1))
            entries = both[:, :e_width].reshape(-1, *e_shape)
            q_rest = both[:, e_width:].contiguous()
            q_space = (q_rest.view(q.dtype) if as_bytes else q_rest).reshape(-1, *q.shape[1:]).to(q.dtype)
        else:
            entries = ctx.gather(entries)
    cache = store_kv(entries, ctx, layer_idx)
    quant = ctx.kv_quant  # entries and cache rows are in its format, if any
    # Parts: context shard by shard (exchanged), gathered context, new keys.
    outs = torch.zeros(3, n, heads, out_dim, dtype=torch.float32, device=q.device)
    lses = torch.full((3, n, heads), float("-inf"), dtype=torch.float32, device=q.device)
    if step.replicated_context or pass_q:
        skip = split.rows if gather_context else frozenset()
        outs[0], lses[0] = _context_partials(q_space, cache, ctx, attend, decode, out_dim, skip)
    if gather_context:
        outs[1], lses[1] = gathered_context_attention(local_q, cache, split, ctx.gather, attend, out_dim, quant)
    qsl = ctx.query_start_loc
    for r, idx in enumerate(step.new_key_idx):
        a, b = qsl[r], qsl[r + 1]
        if b > a:
            q_row, kv = local_q[a:b], entries.index_select(0, idx)  # the row's queries are its last new keys
            outs[2, a:b], lses[2, a:b] = bottom_right_causal(
                b - a, len(idx), lambda keys, causal: attend(q_row, kv[keys], causal, quant)
            )
    return merge_attention(outs, lses)[0].to(q.dtype)


def _context_partials(
    q_space: torch.Tensor,
    cache: torch.Tensor,
    ctx: ForwardContext,
    attend: Attend,
    decode: Decode,
    out_dim: int,
    skip: frozenset[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token's attention over my shard of its row's context (but the
    ``skip`` rows': their context is gathered), exchanged so that each rank
    gets its local tokens' partials from every rank, merged: (n, H, out_dim), (n, H).
    One-query rows (decodes) go through ``decode`` together, the others row by row."""
    step = ctx.dcp
    assert step is not None  # under DCP
    T, heads = len(step.query_idx), q_space.shape[1]
    # Row T stays empty (out 0, lse -inf): the partial sent for padding tokens.
    partial = torch.zeros(T + 1, heads, out_dim + 1, dtype=torch.float32, device=q_space.device)
    partial[:, :, out_dim] = float("-inf")
    qsl = step.query_start_loc
    done: set[int] = set()
    single = _one_query_rows(step, skip, ctx.memo)
    if single is not None:
        tokens = single.tokens
        q_single = q_space.index_select(0, step.query_idx[tokens])
        res = decode(q_single, cache, single.slots, single.starts, ctx.kv_quant)
        if res is not None:
            partial[tokens, :, :out_dim], partial[tokens, :, out_dim] = res
            done = set(single.rows)
    for r, slots in enumerate(step.shard_slots):
        if len(slots) and r not in skip and r not in done:  # an empty shard: nothing computed, lse -inf sent
            q_row = q_space.index_select(0, step.query_idx[qsl[r] : qsl[r + 1]])
            out, lse = attend(q_row, cache.index_select(0, slots), False, ctx.kv_quant)
            partial[qsl[r] : qsl[r + 1], :, :out_dim], partial[qsl[r] : qsl[r + 1], :, out_dim] = out, lse
    send = partial.index_select(0, step.send_idx.view(-1)).view(*step.send_idx.shape, *partial.shape[1:])
    received = step.all_to_all(send)  # (D, n, H, out_dim + 1): my tokens' partials from each rank
    return merge_attention(received[..., :out_dim], received[..., out_dim])


def _one_query_rows(step: DCPStep, skip: frozenset[int], memo: StepMemo) -> OneQueryRows | None:
    """The step's one-query rows but ``skip``'s, for ``decode``; None if there
    are none. The same in every layer: memoised."""
    if skip not in memo.one_query_rows:
        qsl = step.query_start_loc
        rows = [r for r in range(len(step.shard_slots)) if qsl[r + 1] - qsl[r] == 1 and r not in skip]
        memo.one_query_rows[skip] = None
        if rows:
            tokens = torch.tensor([qsl[r] for r in rows], device=step.query_idx.device)
            memo.one_query_rows[skip] = OneQueryRows(rows, tokens, *concat_slots([step.shard_slots[r] for r in rows]))
    return memo.one_query_rows[skip]
