"""Split prefill rows under DCP: gather their cached context from the shards.

A row split by PCP has its queries spread over the ranks and its cached
context spread over the shards. ctxpar reaches that context one of two ways
(ctxpar/layers/sharded_attention.py runs both):

- **pass-Q**: the queries travel (in the step's KV all-gather), every rank
  attends all of them over its shard, and one all-to-all returns each rank its
  tokens' partials. Moves the step's queries and partials, whatever the context.
- **gather the context** (here, vLLM's way): every rank all-gathers the row's
  context entries from the shards, in rounds of at most ``workspace_tokens``
  positions (never a whole long context on every rank at once), de-interleaves
  them into position order and attends its own queries over them locally,
  merging the rounds exactly by log-sum-exp. Moves the context, whatever the
  number of queries.

The choice is made per step by ``gathers_context`` from what each path moves,
with shapes every rank has (the plan's context lengths, the padded step size,
the model's head shapes), never a rank's own shard length: a branch that
differs between ranks would hang the group (vLLM bug #53573). The engine times
both paths with the link and memory rates of its hardware profile
(ctxpar/parallel/context_cost.py); a user's ``dcp_gather_ratio`` compares bytes instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import torch

from ctxpar.checks import check_float
from ctxpar.errors import CtxparError
from ctxpar.layers.attention_math import merge_attention
from ctxpar.parallel.context_cost import GATHER_COST_RATIO, WORKSPACE_TOKENS, ContextCost, MovedBytes, gathers
from ctxpar.parallel.context_cost import moved_bytes as moved_bytes_of
from ctxpar.parallel.dcp_shard import DCPShard

if TYPE_CHECKING:
    from ctxpar.layers.kv_quant import KVQuant
    from ctxpar.parallel.pcp import RankRows

PATHS = ("auto", "gather", "pass_q")


@dataclass(frozen=True)
class GatherPolicy:
    """How split prefill rows with cached context reach it under DCP.

    path: "auto" (the rule of ``gathers_context``), or "gather" / "pass_q"
    to force one (tests and benchmarks compare them). workspace_tokens: context
    positions all-gathered per round, which bounds the temporary memory.
    cost: the rates the engine's hardware profile gives (ctxpar/costmodel/policy.py):
    "auto" takes the path predicted faster; None: the one that moves fewer bytes,
    gathering when its bytes are below ``ratio`` times pass-Q's (the user's
    dcp_gather_ratio, else GATHER_COST_RATIO).
    """

    path: str = "auto"
    workspace_tokens: int = WORKSPACE_TOKENS
    cost: ContextCost | None = None
    ratio: float = GATHER_COST_RATIO

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise CtxparError(f"context path must be one of {list(PATHS)}, got {self.path!r}")
        if not isinstance(self.workspace_tokens, int) or self.workspace_tokens < 1:
            raise CtxparError(f"workspace_tokens must be an integer >= 1, got {self.workspace_tokens!r}")
        check_float("dcp_gather_ratio", self.ratio, 0.0)


@dataclass
class ContextRound:
    """One all-gather of context entries, the same on every rank but for its slots."""

    send_slots: torch.Tensor  # (m,) int64: my cache slots to send, every piece padded to its widest rank
    order: torch.Tensor  # (S,) int64: the gathered (D*m) entries' rows in position order, piece after piece
    pieces: list[tuple[int, int, torch.Tensor]]  # [start, end) of a row's piece in order, its local query tokens


@dataclass
class SplitContext:
    """The split rows with cached context of one step."""

    rows: frozenset[int]  # their global rows (pass-Q attends them shard by shard)
    context_tokens: int  # their context positions, in all
    policy: GatherPolicy
    shard: DCPShard
    pieces: list[tuple[int, np.ndarray, np.ndarray]]  # per row: context length, my shard's slots, my query tokens
    to_dev: Callable[[np.ndarray], torch.Tensor]

    @cached_property
    def rounds(self) -> list[ContextRound]:
        """How to gather the context: planned on first use, so a step whose
        layers take pass-Q never plans it (then once for all layers)."""
        return plan_rounds(self.shard, self.pieces, self.policy.workspace_tokens, self.to_dev)


def split_context(
    shard: DCPShard,
    is_split: np.ndarray,
    context_lens: np.ndarray,
    rows: RankRows,
    shard_slots: list[np.ndarray],
    policy: GatherPolicy,
    to_dev: Callable[[np.ndarray], torch.Tensor],
) -> SplitContext | None:
    """The step's split rows with cached context and their rounds of context
    gathering, or None if it has none.

    is_split, context_lens: (R,) per global row (the PCP layout, the plan);
    rows: this rank's ctxpar.parallel.pcp.RankRows; shard_slots: R x my
    shard's cache slots of each row's context, in local order. The rounds
    themselves are planned only if a layer gathers (``SplitContext.rounds``).
    """
    split = np.flatnonzero(is_split & (context_lens > 0))
    if len(split) == 0:
        return None
    # My local tokens of each such row (its one or two chunks on this rank; none if it is short).
    token_req = np.repeat(rows.req_idx, rows.num_tokens)
    token_split = ~np.repeat(rows.is_replicated, rows.num_tokens)
    pieces = [(int(context_lens[r]), shard_slots[r], np.flatnonzero(token_split & (token_req == r))) for r in split]
    return SplitContext(frozenset(split.tolist()), int(context_lens[split].sum()), policy, shard, pieces, to_dev)


def plan_rounds(
    shard: DCPShard,
    rows: list[tuple[int, np.ndarray, np.ndarray]],
    workspace: int,
    to_dev: Callable[[np.ndarray], torch.Tensor],
) -> list[ContextRound]:
    """Cut the rows' contexts into rounds of at most ``workspace`` positions.

    rows: per split row with context, (context length c, my shard's cache slots
    of positions [0, c) in local order, my local query tokens of the row).
    Every rank derives the same rounds and piece widths from the context
    lengths alone; only the slots it sends are its own.
    """
    rounds, pieces, room = [], [], workspace
    for c, slots, tokens in rows:
        start = 0
        while start < c:
            end = min(c, start + room)
            pieces.append((start, end, slots, tokens))
            room -= end - start
            start = end
            if room == 0:
                rounds.append(_round(shard, pieces, to_dev))
                pieces, room = [], workspace
    if pieces:
        rounds.append(_round(shard, pieces, to_dev))
    return rounds


def _round(shard: DCPShard, pieces: list, to_dev) -> ContextRound:
    """One round of (start, end, my shard's slots of the row, my query tokens) pieces."""
    layouts = [shard.range_layout(a, b) for a, b, _, _ in pieces]
    widths = [int(counts.max()) for counts, _, _, _ in layouts]
    m, offsets, k = sum(widths), np.cumsum([0] + widths), shard.rank
    send, order, out, at = [], [], [], 0
    for (a, b, slots, tokens), (counts, first, owner, index), w, off in zip(pieces, layouts, widths, offsets):
        mine = slots[first[k] : first[k] + counts[k]]
        send.append(np.concatenate([mine, np.zeros(w - len(mine), dtype=np.int64)]))  # padding reads slot 0
        order.append(owner * m + off + index)
        out.append((at, at + b - a, to_dev(tokens)))
        at += b - a
    return ContextRound(to_dev(np.concatenate(send)), to_dev(np.concatenate(order)), out)


def moved_bytes(
    context_tokens: int, q: torch.Tensor, entries: torch.Tensor, out_dim: int, ranks: int, exchange_anyway: bool
) -> MovedBytes:
    """What each path moves (ctxpar.parallel.context_cost.moved_bytes) for the step's
    local queries q (n, H, Dq) and cache entries (n, *E). n is padded to the same value
    on every rank, so every rank computes the same bytes."""
    # Queries travel in the entries' dtype, or as their own bytes beside quantized (uint8) rows.
    q_bytes = q.element_size() if entries.dtype == torch.uint8 else entries.element_size()
    entry_bytes = entries[0].numel() * entries.element_size()
    return moved_bytes_of(
        context_tokens, q.shape[0], q.shape[1], q[0].numel() * q_bytes, entry_bytes, out_dim, ranks, exchange_anyway
    )


def gathers_context(
    policy: GatherPolicy,
    context_tokens: int,
    q: torch.Tensor,
    entries: torch.Tensor,
    out_dim: int,
    ranks: int,
    exchange_anyway: bool,
) -> bool:
    """Whether a step's split rows with ``context_tokens`` of cached context
    gather it (else pass-Q): the policy's forced path, or under "auto" the path
    its ``cost`` predicts faster, or without one, gather when its bytes are below
    ``ratio`` times pass-Q's (``moved_bytes``)."""
    if policy.path != "auto":
        return policy.path == "gather"
    moved = moved_bytes(context_tokens, q, entries, out_dim, ranks, exchange_anyway)
    return gathers(moved, context_tokens, ranks, policy.workspace_tokens, policy.cost, policy.ratio)


def gathered_context_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    split: SplitContext,
    gather,
    attend,
    out_dim: int,
    quant: KVQuant | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """My local queries of the split rows over their whole gathered context,
    unmasked (every query sees all of its context): out (n, H, out_dim), lse
    (n, H); other tokens get out 0 and lse -inf.

    gather: the group's all-gather; attend: ctxpar.layers.sharded_attention.Attend;
    quant: the cache's quantized format, if any (its rows travel as bytes, and
    ``attend`` reads them as they are).
    """
    n, heads = q.shape[0], q.shape[1]
    out = torch.zeros(n, heads, out_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((n, heads), float("-inf"), dtype=torch.float32, device=q.device)
    for rnd in split.rounds:  # every rank runs every round: its collective is global
        kv = gather(cache.index_select(0, rnd.send_slots)).index_select(0, rnd.order)
        for a, b, tokens in rnd.pieces:
            if len(tokens):
                o, l = attend(q.index_select(0, tokens), kv[a:b], False, quant)
                merged = merge_attention(torch.stack([out[tokens], o]), torch.stack([lse[tokens], l]))
                out[tokens], lse[tokens] = merged
    return out, lse
