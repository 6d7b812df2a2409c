"""Attention over a KV cache sharded across the DCP ranks (docs/architecture.md, decode context parallelism).

Each rank stores only the KV entries it owns (ctxpar/parallel/dcp_shard.py), so
no rank can attend a query's keys alone. Per layer, after every rank has
stored the step's entries it owns:

1. every query of the step reaches every rank: a split step's queries ride in
   the all-gather that carries the KV entries (pass-Q); a step whose rows are
   all replicated has them on every rank already;
2. each rank d attends every query over its shard's keys at positions up to
   the query's own: a prefix of the shard's slots of the query's row, one key
   count per query (a layer with a sliding window: the run of them inside the
   window, from a first key per query, ``DCPStep.windowed``). A prompt position attends in the prefill kernel, a
   generated token or a draft in the decode kernel (as at D = 1,
   ctxpar/layers/attention/paged.py) -> a partial (out_d, lse_d);
3. one all-to-all brings each rank its own tokens' partials from every rank,
   merged in rank order by ``merge_attention``: ``L = logsumexp_d lse_d``,
   ``out = Σ_d exp(lse_d − L) · out_d``. A shard holding none of a query's
   keys sends lse = -inf, which weighs nothing (never NaN).

So a query's arithmetic is the same whatever else runs: the same kernel over
the same keys for each shard (the kernels give a query the same bits whichever
queries share the call), the same merge in the same order. Where the step's
context ends and its new keys begin, how the prompt was chunked, whether its
prefix came from the cache: none of it enters (README, "The same bits whatever
else runs"). Every collective runs once per layer with shapes fixed by the
plan, whatever a rank's shard holds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ctxpar.layers.attention.backend import AttentionBackend, DecodeGroup, Partials
from ctxpar.layers.attention.torch_ops import merge_attention
from ctxpar.layers.forward_context import ForwardContext, store_kv, to_cache
from ctxpar.layers.kv_quant import KVQuant

# attend(backend, q (L, H, Dq), kv, counts, quant, firsts) -> (out (L, H, Do), lse (L, H)) float32,
# kv the entries (m, *E), or with `quant` their cache rows (m, row_bytes) in that format (read in
# place where a kernel can); counts (L,) int64: query i sees kv[:counts[i]], 1 <= counts[i] <= m;
# firsts (L,) int64 or None: and none before kv[firsts[i]] (a sliding window's).
Attend = Callable[
    [AttentionBackend, torch.Tensor, torch.Tensor, torch.Tensor, KVQuant | None, torch.Tensor | None], Partials
]
# decode(backend, q (B, H, Dq), cache, group, quant) -> (out (B, H, Do), lse (B, H)) float32:
# one query per row over the cache slots of its row in ``group``, all rows in one call that
# reads the cache in place (given only where the backend ``reads_paged`` the cache).
Decode = Callable[[AttentionBackend, torch.Tensor, torch.Tensor, DecodeGroup, KVQuant | None], Partials]


def sharded_attention(
    q: torch.Tensor,
    entries: torch.Tensor,
    ctx: ForwardContext,
    layer_idx: int,
    attend: Attend,
    out_dim: int,
    decode: Decode | None,
    window: int | None = None,
) -> torch.Tensor:
    """Write this rank's share of the layer's KV entries, attend every query of the
    step over this rank's shard, and merge each local token's partials across ranks.

    q: (n, H, Dq) local queries; entries: (n, *E) local KV-cache inputs;
    attend, decode: the model's attention over a prefix of keys per query, and
    of one-query rows over the paged cache (None: the backend does not read this
    cache in place, and those rows go through ``attend``); window: the layer's sliding
    window (keys), if any; returns (n, H, out_dim) attention outputs of the local
    tokens (0 on padding).
    """
    step = ctx.dcp
    assert step is not None  # under DCP
    if window is not None:
        assert step.windowed is not None  # every DCPStep of a step description has it (dcp_metadata.py)
        step = step.windowed(window)
    n, heads = q.shape[0], q.shape[1]
    entries = to_cache(entries, ctx)  # quantized (if so) before any gather: ranks exchange stored bytes
    q_space = q  # every query of the step; without a gather every rank has them all, at their global index
    if ctx.gather is not None:  # split step: one all-gather carries the KV entries and the queries
        e_shape, e_width = entries.shape[1:], entries[0].numel()
        # Quantized rows are bytes: the queries travel as their bytes too, exactly.
        as_bytes = ctx.kv_quant is not None
        q_part = q.contiguous().view(torch.uint8) if as_bytes else q.to(entries.dtype)
        both = ctx.gather(torch.cat([entries.reshape(n, -1), q_part.reshape(n, -1)], dim=1))
        entries = both[:, :e_width].reshape(-1, *e_shape)
        q_rest = both[:, e_width:].contiguous()
        q_space = (q_rest.view(q.dtype) if as_bytes else q_rest).reshape(-1, *q.shape[1:]).to(q.dtype)
    cache = store_kv(entries, ctx, layer_idx)  # every key of the step is in its shard before anyone attends
    backend, quant = ctx.attention, ctx.kv_quant
    # Row T stays empty (out 0, lse -inf): the partial sent for padding tokens, and for
    # queries this shard holds no key of.
    T = len(step.query_idx)
    partial = torch.zeros(T + 1, heads, out_dim + 1, dtype=torch.float32, device=q.device)
    partial[:, :, out_dim] = float("-inf")
    spans = step.prompt + step.generated
    if step.decodes is not None and decode is not None:
        dec = step.decodes
        res = decode(backend, q_space.index_select(0, step.query_idx[dec.tokens]), cache, dec, quant)
        partial[dec.tokens, :, :out_dim], partial[dec.tokens, :, out_dim] = res
        spans = step.prompt
    for sp in spans:
        q_rows = q_space.index_select(0, step.query_idx[sp.start : sp.end])
        out, lse = attend(backend, q_rows, cache.index_select(0, sp.slots), sp.counts, quant, sp.firsts)
        partial[sp.start : sp.end, :, :out_dim], partial[sp.start : sp.end, :, out_dim] = out, lse
    send = partial.index_select(0, step.send_idx.view(-1)).view(*step.send_idx.shape, *partial.shape[1:])
    received = step.all_to_all(send)  # (D, n, H, out_dim + 1): my tokens' partials from each rank, in rank order
    return merge_attention(received[..., :out_dim], received[..., out_dim])[0].to(q.dtype)
