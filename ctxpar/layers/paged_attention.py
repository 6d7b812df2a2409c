"""Attention of a step's local rows over the paged KV cache, dispatched by query kind.

- With ctxpar's kernels (the CPU), by the query's position: a position past its
  request's prompt (a decode, a speculative draft, a generated token recomputed
  after a lost rank or a preemption) attends in the decode kernel, every such
  query of the step in one call that reads each key and value once, in place,
  each query over its causal prefix; a prompt position attends in the prefill
  kernel, its row's prompt queries in one call. Each kernel gives a query the
  same bits whichever queries share its call, so a token's attention depends
  on its query and its context only: not on the batch, on how its prompt was
  chunked (``max_num_batched_tokens``, PCP's chunks), on a prefix-cache hit, or
  on a recovery (DESIGN.md §7).
- Elsewhere (a GPU, or ``CTXPAR_KERNELS=0``, or no compiler) one-query rows of
  at most ``DECODE_BATCH_MAX_KEYS`` keys go in batched ``decode_attention``
  calls: their contexts are read out of the cache by one gather per call into
  the layout the GEMMs want. Rows of similar context length share a call
  (sorted by length, a group closes before padding would exceed
  ``MAX_PADDING`` of its keys): decode is memory-bound, and reading padding
  costs as much as reading keys. Other rows attend one by one with
  ``causal_attention``. PyTorch's kernels choose their blocking by shape, so
  there a token's bits may depend on its company.

The index tensors of the decode batch are the same for every layer of a step,
so they are built once and kept in the step's ``StepMemo``.

A quantized cache (ctxpar/layers/kv_quant.py) is read by the same kernels, which
dequantize a run of keys at a time. Only where no kernel runs (a GPU,
``CTXPAR_KERNELS=0``, head widths the kernels' vectors do not divide) are the
rows' contexts dequantized.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ctxpar.kernels import attention_kernels as attn_kernels
from ctxpar.layers.attention_math import causal_attention, paged_kernel
from ctxpar.layers.attention_ops import concat_slots, decode_attention, gather_paged_kv
from ctxpar.layers.forward_context import DecodeBatch, DecodeGroup, ForwardContext
from ctxpar.layers.kv_quant import KVQuant

MAX_PADDING = 0.25  # padded keys a decode group may add, as a share of its real keys
# Without the kernel, longer one-query rows attend one by one: there the gather
# dominates, and one index_select of whole slots per row (then PyTorch's kernel)
# beats the batched call's gather of per-head rows. Measured per 30-layer step at
# SmolLM2's shapes, the two break even at about this many keys per row.
DECODE_BATCH_MAX_KEYS = 128


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


def decode_batch(ctx: ForwardContext, kernel: bool) -> DecodeBatch | None:
    """The step's decode-kernel queries in groups, or None if it has none (memoised per
    step): with the ``kernel``, every query past its row's prompt, in one group;
    without, the one-query rows of at most DECODE_BATCH_MAX_KEYS keys, in length groups."""
    if kernel not in ctx.memo.decode_batches:
        qsl = ctx.query_start_loc
        counts = [qsl[r + 1] - qsl[r] for r in range(ctx.num_rows)]
        if kernel:
            prompt = [ctx.prompt_queries(r) for r in range(ctx.num_rows)]
        else:
            prompt = [0 if n == 1 and ctx.seq_lens[r] <= DECODE_BATCH_MAX_KEYS else n for r, n in enumerate(counts)]
        # (query token, keys it attends): query j of a row sees its context and its first j + 1 tokens.
        queries = [
            (t, ctx.seq_lens[r] - (qsl[r + 1] - t) + 1, r)
            for r in range(ctx.num_rows)
            for t in range(qsl[r] + prompt[r], qsl[r + 1])
        ]
        batch = None
        if queries:
            device = ctx.context_slots[queries[0][2]].device
            groups = []
            for members in [list(range(len(queries)))] if kernel else _group_by_length([n for _, n, _ in queries]):
                tokens = torch.tensor([queries[i][0] for i in members], dtype=torch.int64, device=device)
                slots = [ctx.context_slots[queries[i][2]][: queries[i][1]] for i in members]
                groups.append(DecodeGroup(tokens, *concat_slots(slots)))
            whole = len(groups) == 1 and [t for t, _, _ in queries] == list(range(qsl[-1]))
            batch = DecodeBatch(prompt, groups, whole)
        ctx.memo.decode_batches[kernel] = batch
    return ctx.memo.decode_batches[kernel]


def prompt_spans(ctx: ForwardContext, dec: DecodeBatch | None) -> Iterator[tuple[int, int, torch.Tensor]]:
    """The queries no decode group took (prompt positions), row by row: (a, b, slots),
    local tokens [a, b) over their causal prefix, the row's first start + (b - a) slots."""
    qsl = ctx.query_start_loc
    for r in range(ctx.num_rows):
        a = qsl[r]
        b = a + (dec.prompt_queries[r] if dec is not None else qsl[r + 1] - a)
        if b > a:
            yield a, b, ctx.context_slots[r][: ctx.start_pos[r] + b - a]


def gqa_paged_attention(q: torch.Tensor, cache: torch.Tensor, ctx: ForwardContext, scale: float) -> torch.Tensor:
    """q (n, H, D) of the local tokens, cache (num_slots, 2, Hk, D) (or its
    quantized rows) already holding this step's entries -> attention output
    (n, H, D); padding tokens (after the last row) get zeros."""
    n, _, D = q.shape
    quant = ctx.kv_quant
    qsl = ctx.query_start_loc
    kernel = paged_kernel(cache, D)
    dec = decode_batch(ctx, kernel)
    if kernel and dec is not None and dec.whole and n == qsl[-1]:  # decodes only: ~10 fewer ops a layer
        grp = dec.groups[0]
        return attn_kernels.gqa_paged_decode(q, cache, grp.slots, grp.starts, scale, quant)[0].to(q.dtype)
    out = q.new_empty(n, q.shape[1], D)  # every row's tokens are written below
    out[qsl[-1] :].zero_()  # padding tokens
    for grp in dec.groups if dec is not None else []:
        q_rows = q.index_select(0, grp.tokens)
        if kernel:
            o, _ = attn_kernels.gqa_paged_decode(q_rows, cache, grp.slots, grp.starts, scale, quant)
        else:
            table, lengths = grp.padded
            k, v = _padded_kv(cache, table, quant)  # (B, Hk, S, D) each
            o, _ = decode_attention(q_rows, k.to(q.dtype), v.to(q.dtype), lengths, scale)
        out.index_copy_(0, grp.tokens, o.to(out.dtype))
    for a, b, slots in prompt_spans(ctx, dec):
        kv = cache.index_select(0, slots)  # (S, 2, Hk, D), or (S, row_bytes) quantized
        if quant is None:
            causal_attention(q[a:b], kv[:, 0], kv[:, 1], scale, out=out[a:b])
        elif attn_kernels.prefill_quant_usable(q[a:b], quant):
            attn_kernels.prefill_attention_quant(q[a:b], kv, quant, scale, out=out[a:b])
        else:
            kv = quant.dequantize(kv).to(q.dtype)
            causal_attention(q[a:b], kv[:, 0], kv[:, 1], scale, out=out[a:b])
    return out


def _padded_kv(cache: torch.Tensor, table: torch.Tensor, quant: KVQuant | None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (B, Hk, S, D) each at the slots of a (B, S) table (the path without the kernel)."""
    if quant is None:
        return gather_paged_kv(cache, table)
    B, S = table.shape
    kv = quant.dequantize(cache.index_select(0, table.view(-1))).view(B, S, *quant.entry_shape)  # (B, S, 2, Hk, D)
    return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)


def latent_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    grp: DecodeGroup,
    value_dim: int,
    scale: float,
    kernel: bool,
    quant: KVQuant | None,
) -> torch.Tensor:
    """MLA decode in latent space for a group of one-query rows: q (B, H, E)
    against cached entries (num_slots, E) (or their quantized rows) that serve
    as the single shared key, whose first value_dim values are the value.
    Returns (B, H, value_dim). kernel: ``paged_kernel`` for this cache and these widths."""
    if kernel:
        out, _ = attn_kernels.latent_paged_decode(q, cache, grp.slots, grp.starts, value_dim, scale, quant)
        return out.to(q.dtype)
    table, lengths = grp.padded
    B, S = table.shape
    rows = cache.index_select(0, table.view(-1))
    k = (rows if quant is None else quant.dequantize(rows)).view(B, 1, S, q.shape[-1]).to(q.dtype)
    out, _ = decode_attention(q, k, k[..., :value_dim], lengths, scale)
    return out
