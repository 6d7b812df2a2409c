"""What attention layers read of a step: what one forward pass needs besides
the token ids.

Each step has one ``ForwardContext`` (the rank-local rows, where their KV
lives in the paged cache, how to gather KV over the ranks and, under DCP, a
``DCPStep``), built by attention_metadata.py from the runner's
StepDescription; attention layers read it and nothing else, so they know
only "gather my KV inputs, write them, attend" (docs/architecture.md).
Values that every layer of a step would otherwise rebuild go in its
``StepMemo``, filled by the first layer that needs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ctxpar.layers.attention.backend import AttentionBackend, DecodeGroup, default_backend
from ctxpar.layers.kv_quant import KVQuant


@dataclass
class DecodeBatch:
    # Per local row, its leading queries left to the row's own call (prompt positions);
    # the rest are in the groups.
    prompt_queries: list[int]
    groups: list[DecodeGroup]
    # One group whose queries are every local token of the rows, in order (a step of
    # decodes): its output is the layer's as it comes, with no gather or scatter.
    whole: bool = False


@dataclass
class StepMemo:
    """Per-step values, the same in every layer: built by the first layer that needs them."""

    # The one-query rows in groups (ctxpar/layers/attention/paged.py's decode_batch), keyed by whether the
    # compiled kernel reads the cache (one group) or not (length groups).
    decode_batches: dict[bool, DecodeBatch | None] = field(default_factory=dict)


@dataclass(frozen=True)
class ShardQueries:
    """One row's queries of one kind (prompt positions, or generated tokens) over this
    rank's shard of the row's keys: the step's tokens [start, end) in global order,
    query i over the first counts[i] of ``slots`` (its shard's keys up to its position),
    from firsts[i] on where a sliding window hides the earlier ones."""

    start: int
    end: int
    slots: torch.Tensor  # (m,) int64: my shard's cache slots of the row in position order, m = counts[-1]
    counts: torch.Tensor  # (end - start,) int64, each >= 1 (a query my shard holds no key of is left out)
    firsts: torch.Tensor | None = None  # (end - start,) int64 in [0, counts[i]]; None: every key from the first


@dataclass
class DCPStep:
    """What the sharded attention of one step needs, the same for every layer: every
    query of the step over this rank's shard (ctxpar/layers/attention/sharded.py)."""

    query_idx: torch.Tensor  # (T,) int64: row of each global token in the query space
    prompt: list[ShardQueries]  # prompt positions, row by row: the prefill kernel
    generated: list[ShardQueries]  # generated tokens and drafts, row by row: the decode kernel
    decodes: DecodeGroup | None  # the generated ones in one decode-kernel call (tokens: global)
    send_idx: torch.Tensor  # (D, n) int64: global token of each rank's local token; T on padding
    all_to_all: Callable[[torch.Tensor], torch.Tensor]  # (D, n, ...) -> (D, n, ...)
    # The step as a layer with a sliding window of this many keys attends it (its spans'
    # firsts, its decode rows cut to the window's keys), built once per window (dcp_metadata.py).
    windowed: Callable[[int], DCPStep] | None = None


@dataclass
class ForwardContext:
    # Local rows (this rank). A row is a contiguous run of one request's tokens.
    query_start_loc: list[int]  # (rows + 1,) local token range of each row
    start_pos: list[int]  # (rows,) absolute position of each row's first token
    seq_lens: list[int]  # (rows,) start_pos + num_tokens: keys each row attends to
    context_slots: list[torch.Tensor]  # rows x (seq_len,) int64 cache slot of positions [0, seq_len)
    # Cache writes: rows of the (gathered) KV entries to store, and where.
    write_src: torch.Tensor | None  # (W,) int64 index into the entries; None = all of them, in order
    write_slots: torch.Tensor  # (W,) int64 flat slot in each layer's cache
    kv_caches: list[torch.Tensor]  # per layer: (num_slots, *kv_entry_shape), or quantized rows
    # The cache's quantization (ctxpar/layers/kv_quant.py); None: entries stored as computed.
    kv_quant: KVQuant | None = None
    # All-gather over the PCP group: (n, ...) -> (P*n, ...). None: KV stays local.
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Decode context parallelism: the cache holds this rank's shard only, and the layers
    # attend through ctxpar.layers.attention.sharded (context_slots unused). None: a full cache.
    dcp: DCPStep | None = None
    memo: StepMemo = field(default_factory=StepMemo)
    # Each local row's prompt length (None: every query is a prompt position). A query at
    # a prompt position attends in the prefill kernel, any other (a generated token, a
    # draft) in the decode kernel, wherever the row is cut (ctxpar/layers/attention/paged.py).
    prompt_lens: list[int] | None = None
    # Where attention runs: the backend the rank chose at load (AttentionMetadataBuilder).
    # None in a context built by hand (tests, calibration): the device's default, at each call.
    backend: AttentionBackend | None = None

    @property
    def attention(self) -> AttentionBackend:
        """The step's attention backend (ctxpar/layers/attention/backend.py)."""
        return self.backend if self.backend is not None else default_backend(self.write_slots.device)

    @property
    def num_rows(self) -> int:
        return len(self.start_pos)

    def prompt_queries(self, r: int) -> int:
        """How many of local row r's queries, from its first, are prompt positions."""
        queries = self.query_start_loc[r + 1] - self.query_start_loc[r]
        if self.prompt_lens is None:
            return queries
        return min(queries, max(0, self.prompt_lens[r] - self.start_pos[r]))


def gather_and_store_kv(entries: torch.Tensor, ctx: ForwardContext, layer_idx: int) -> torch.Tensor:
    """All-gather this step's KV-cache entries of one layer over the ranks (a
    split step), then write them; returns the layer's cache (num_slots, *E).

    entries: (n, *E) the KV-cache inputs of the local (padded) tokens; E is the
    per-token entry shape of the layer (GQA: (2, kv_heads, head_dim); MLA:
    (kv_lora_rank + rope_dim,)). The context of a row includes the other
    ranks' chunks of this very step, which is why every rank gathers and
    writes before anyone attends.
    """
    entries = to_cache(entries, ctx)  # quantized before the gather: ranks exchange the bytes they store
    if ctx.gather is not None:
        entries = ctx.gather(entries)  # (P*n, *E)
    return store_kv(entries, ctx, layer_idx)


def to_cache(entries: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    """(n, *E) entries as the cache stores them: (n, row_bytes) quantized rows, or unchanged."""
    return entries if ctx.kv_quant is None else ctx.kv_quant.quantize(entries)


def from_cache(rows: torch.Tensor, ctx: ForwardContext, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows (m, ...) read back as (m, *E) entries of ``dtype`` (dequantized: a copy)."""
    return (rows if ctx.kv_quant is None else ctx.kv_quant.dequantize(rows)).to(dtype)


def store_kv(entries: torch.Tensor, ctx: ForwardContext, layer_idx: int) -> torch.Tensor:
    """Write the step's entries (already gathered, if the step gathers) that
    this rank stores into layer ``layer_idx``'s cache; returns that cache."""
    cache = ctx.kv_caches[layer_idx]
    if ctx.write_src is not None:
        entries = entries.index_select(0, ctx.write_src)
    cache.index_copy_(0, ctx.write_slots, entries.to(cache.dtype))
    return cache
