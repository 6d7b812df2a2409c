"""Attention of a step's local rows over the paged KV cache, dispatched by query kind.

- Where the step's backend reads the cache in place (ctxpar's kernels, on the
  CPU: ``AttentionBackend.reads_paged``), by the query's position: a position past its
  request's prompt (a decode, a speculative draft, a generated token recomputed
  after a lost rank or a preemption) attends in the decode kernel, every such
  query of the step in one call that reads each key and value once, in place,
  each query over its causal prefix; a prompt position attends in the prefill
  kernel, its row's prompt queries in one call. Each kernel gives a query the
  same bits whichever queries share its call, so a token's attention depends
  on its query and its context only: not on the batch, on how its prompt was
  chunked (``max_num_batched_tokens``, PCP's chunks), on a prefix-cache hit, or
  on a recovery (README, "The same bits whatever else runs").
- Elsewhere (a GPU, or ``CTXPAR_KERNELS=0``, or no compiler: the PyTorch
  backend) one-query rows of at most ``DECODE_BATCH_MAX_KEYS`` keys go in
  batched ``decode_attention`` calls: their contexts are read out of the cache by one gather per call into
  the layout the GEMMs want. Rows of similar context length share a call
  (sorted by length, a group closes before padding would exceed
  ``MAX_PADDING`` of its keys): decode is memory-bound, and reading padding
  costs as much as reading keys. Other rows attend one by one (the
  backend's ``prefill``). PyTorch's kernels choose their blocking by shape, so
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

from ctxpar.layers.attention.backend import KEY_BLOCK_ALIGN, AttentionSpec, DecodeGroup
from ctxpar.layers.attention.torch_ops import concat_slots
from ctxpar.layers.forward_context import DecodeBatch, ForwardContext

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


def window_keys(slots: torch.Tensor, queries: int, window: int | None) -> torch.Tensor:
    """The slots (S,) that ``queries`` queries, the last of them, read under a sliding window:
    from the run of KEY_BLOCK_ALIGN keys that holds the first query's first key on, so the
    keys no query sees are not copied, and the kernel's blocks, and bits, stay as they were."""
    if window is None:
        return slots
    first = max(0, len(slots) - queries + 1 - window)
    return slots[first // KEY_BLOCK_ALIGN * KEY_BLOCK_ALIGN :]


def gqa_paged_attention(q: torch.Tensor, cache: torch.Tensor, ctx: ForwardContext, spec: AttentionSpec) -> torch.Tensor:
    """q (n, H, D) of the local tokens, cache (num_slots, 2, Hk, D) (or its
    quantized rows) already holding this step's entries -> attention output
    (n, H, D); padding tokens (after the last row) get zeros."""
    n, _, D = q.shape
    backend, quant = ctx.attention, ctx.kv_quant
    qsl = ctx.query_start_loc
    in_place = backend.reads_paged(cache, D)
    dec = decode_batch(ctx, in_place)
    if in_place and dec is not None and dec.whole and n == qsl[-1]:  # decodes only: ~10 fewer ops a layer
        return backend.gqa_decode(q, cache, dec.groups[0], spec, quant)[0].to(q.dtype)
    out = q.new_empty(n, q.shape[1], D)  # every row's tokens are written below
    out[qsl[-1] :].zero_()  # padding tokens
    for grp in dec.groups if dec is not None else []:
        o, _ = backend.gqa_decode(q.index_select(0, grp.tokens), cache, grp, spec, quant)
        out.index_copy_(0, grp.tokens, o.to(out.dtype))
    for a, b, slots in prompt_spans(ctx, dec):
        rows = cache.index_select(0, window_keys(slots, b - a, spec.window))  # (S, 2, Hk, D), or (S, row_bytes)
        backend.gqa_prefill_rows(q[a:b], rows, quant, spec, out=out[a:b])
    return out
