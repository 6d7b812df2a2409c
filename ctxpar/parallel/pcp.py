"""The PCP layout planner: which rank computes which tokens of a step (DualChunkSwap).

A pure function of the global batch metadata, so every rank computes the same
layout without communicating. Pure numpy, vectorised over all rows at once: it
runs on the critical path of every step.

A prefilling row of q tokens is cut into 2P contiguous chunks whose lengths
differ by at most one (the first ``q mod 2P`` chunks take the extra token).
Rank k owns chunk k (early, cheap under causal attention) and chunk 2P-1-k
(late, expensive), so every rank gets about the same attention work. Rank P-1
owns the two middle chunks, which touch: it runs them as ONE row. Example,
q = 10 tokens after c cached ones, P = 2 (chunks of 3, 3, 2, 2 tokens)::

    positions   c+0 c+1 c+2 | c+3 c+4 c+5 | c+6 c+7 | c+8 c+9
    chunk            0      |      1      |    2    |    3
    rank 0      [ chunk 0   ]                        [ chunk 3 ]   2 rows, 5 tokens
    rank 1                  [ chunk 1   +   chunk 2 ]              1 row,  5 tokens

A split row may instead go over a contiguous group of w of the ranks
(``split_ranks``, chosen per step by ctxpar/costmodel/policy.py): it is cut
into 2w chunks dealt the same way within the group, and w = 1 computes it
whole on one rank. Several long prompts of a step can so each take their own
ranks instead of all sharing all of them; the index maps and their invariants
are the same.

Rows that are not split (decodes, and prefills shorter than ``replicate_below``)
are, all of a step's together, either replicated or assigned, as
ctxpar/parallel/pcp_spread.py decides from the step's rows. A replicated row
is computed by every rank; only rank 0's copy writes KV and provides the
output. An assigned row is computed by one rank and, like a chunk, gathered
to the others. Each rank orders its rows: replicated or assigned rows, then
chunks with context (start position > 0), then chunks starting at position 0;
each group in global order (request, then position). Attention kernels want
this.

The layout it returns, and the gathered space its index maps address, are
ctxpar/parallel/pcp_layout.py's.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ctxpar.parallel.pcp_inputs import validate_inputs
from ctxpar.parallel.pcp_layout import PCPLayout, exclusive_cumsum, frozen, ragged_arange
from ctxpar.parallel.pcp_spread import assign_ranks, spreads


def chunk_offsets(num_tokens: np.ndarray | int, pcp_size: np.ndarray | int, chunk: np.ndarray | int) -> np.ndarray:
    """Offset (within its row) where balanced chunk ``chunk`` of 2P starts; broadcasts.

    The first ``q mod 2P`` chunks are one token longer, so chunk i starts at
    i * (q // 2P) + min(i, q mod 2P); chunk 2P "starts" at q.
    """
    base, rem = np.divmod(num_tokens, 2 * pcp_size)
    return chunk * base + np.minimum(chunk, rem)


def split_mask(num_scheduled_tokens: np.ndarray, is_prefilling: np.ndarray, replicate_below: int) -> np.ndarray:
    """(R,) bool: the rows a layout splits, prefilling rows of at least ``replicate_below`` tokens (and one)."""
    return is_prefilling & (num_scheduled_tokens >= max(replicate_below, 1))


def plan_pcp_layout(
    num_scheduled_tokens: np.ndarray,
    num_computed_tokens: np.ndarray,
    is_prefilling: np.ndarray,
    pcp_size: int,
    replicate_below: int = 0,
    spread_min_rows: int | None = None,
    split_ranks: tuple[np.ndarray, np.ndarray] | None = None,
) -> PCPLayout:
    """Lay out one step's R rows over ``pcp_size`` ranks with DualChunkSwap.

    Inputs are 1-D arrays of length R (int, int, bool). Rows with no scheduled
    tokens own nothing. Prefilling rows with at least ``replicate_below``
    tokens are split; the other rows are assigned to one rank each when
    ``pcp_spread.spreads(..., spread_min_rows)`` says so (None: never), else
    replicated. ``split_ranks`` (first, width), each (R,) int: split row r goes
    over ranks ``[first[r], first[r] + width[r])`` only, cut into 2 * width[r]
    chunks dealt by DualChunkSwap within that group (width 1: the row whole on
    one rank); None: every split row over all ranks. Entries of other rows are
    ignored. Raises ValueError on invalid input.
    """
    q, c, prefilling = validate_inputs(
        num_scheduled_tokens,
        num_computed_tokens,
        is_prefilling,
        pcp_size,
        replicate_below,
        spread_min_rows,
        split_ranks,
    )
    P = pcp_size
    kinds = _classify_rows(q, prefilling, P, replicate_below, spread_min_rows)
    chunks = _NO_CHUNKS  # a step without split rows (decodes, short rows): stages 2-4 would find none
    if len(kinds.split_rows):
        qs = q[kinds.split_rows]  # (S,)
        first, width = _split_groups(qs, kinds.split_rows, P, split_ranks)
        off, length = _chunk_spans(qs, first, width, P)
        chunks = _chunk_rows(c, kinds.split_rows, off, length)
    own = _own_rows(q, c, kinds.own_rows, chunks, P)
    table = _row_table(q, kinds.rep_rows, own, P)
    qsl = exclusive_cumsum(q)  # (R+1,) row r owns flat tokens [qsl[r], qsl[r+1])
    padded_gather_idx, kv_write_mask, hidden_restore_idx = _token_maps(qsl, table, P)
    return PCPLayout(
        pcp_size=P,
        num_tokens=int(qsl[-1]),
        num_tokens_padded=table.num_tokens_padded,
        per_rank_num_tokens=frozen(table.per_rank),
        padded_gather_idx=frozen(padded_gather_idx),
        kv_write_mask=frozen(kv_write_mask),
        hidden_restore_idx=frozen(hidden_restore_idx),
        is_split=frozen(kinds.is_split),
        is_assigned=frozen(kinds.is_assigned),
        num_replicated_rows=len(kinds.rep_rows),
        rank_row_start=frozen(table.rank_row_start),
        row_req_idx=frozen(table.req),
        row_start_pos=frozen(c[table.req] + table.off),
        row_num_tokens=frozen(table.len),
    )


# The stages of plan_pcp_layout, in order. Arrays are indexed by global row (R,),
# split row (S,), rank (P,) or chunk column (2S: a split row's head and tail chunks).


class _RowKinds(NamedTuple):
    """Which rows a step splits, assigns to one rank, or replicates (rows without tokens: none)."""

    is_split: np.ndarray  # (R,) bool
    is_assigned: np.ndarray  # (R,) bool
    rep_rows: np.ndarray  # (Rr,) replicated rows, in request order
    own_rows: np.ndarray  # (A,) assigned rows, in request order
    split_rows: np.ndarray  # (S,) split rows, in request order


def _classify_rows(
    q: np.ndarray, prefilling: np.ndarray, P: int, replicate_below: int, spread_min_rows: int | None
) -> _RowKinds:
    """Stage 1: split the prefilling rows of at least ``replicate_below`` tokens; the other rows
    with tokens are, all together, assigned or replicated as ``pcp_spread.spreads`` decides."""
    is_split = split_mask(q, prefilling, replicate_below)  # (R,)
    unsplit = ~is_split & (q > 0)  # (R,)
    spread = spreads(int(unsplit.sum()), bool(is_split.any()), P, spread_min_rows)
    is_assigned = unsplit & spread
    rep_rows, own_rows = (unsplit & ~spread).nonzero()[0], is_assigned.nonzero()[0]  # (Rr,), (A,)
    return _RowKinds(is_split, is_assigned, rep_rows, own_rows, is_split.nonzero()[0])


def _split_groups(
    qs: np.ndarray, split_rows: np.ndarray, P: int, split_ranks: tuple[np.ndarray, np.ndarray] | None
) -> tuple[np.ndarray, np.ndarray]:
    """Stage 2: (first, width), each (S,): split row s goes over ranks [first[s], first[s] + width[s])
    (``split_ranks``'s entries of the split rows; None: every rank)."""
    if split_ranks is None:
        return np.zeros_like(qs), np.full_like(qs, P)
    first, width = (np.asarray(a, dtype=np.int64)[split_rows] for a in split_ranks)
    return first, width


def _chunk_spans(qs: np.ndarray, first: np.ndarray, width: np.ndarray, P: int) -> tuple[np.ndarray, np.ndarray]:
    """Stage 3: (offset, length), each (P, 2S), of every rank's two chunks of every split row of
    ``qs`` tokens, columns in (row, head | tail) order; length 0 for a rank outside the row's group.

    The group's j-th rank owns chunk j ("head") and chunk 2w-1-j ("tail") of the row's 2w
    chunks; its last rank's two chunks touch and make one (head) span, its tail empty."""
    j = np.arange(P)[:, None] - first  # (P, S): each rank's index in each row's group
    inside = (j >= 0) & (j < width)
    j = np.clip(j, 0, width - 1)
    off = np.stack([chunk_offsets(qs, width, j), chunk_offsets(qs, width, 2 * width - 1 - j)], axis=2)  # (P, S, 2)
    end = np.stack([chunk_offsets(qs, width, j + 1), chunk_offsets(qs, width, 2 * width - j)], axis=2)
    last = j == width - 1  # the group's last rank: its chunks w-1 and w touch, one row
    end[:, :, 0] = np.where(last, end[:, :, 1], end[:, :, 0])
    end[:, :, 1] = np.where(last, off[:, :, 1], end[:, :, 1])
    end = np.where(inside[:, :, None], end, off)
    return off.reshape(P, -1), (end - off).reshape(P, -1)


def _chunk_rows(
    c: np.ndarray, split_rows: np.ndarray, off: np.ndarray, length: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Stage 4: the non-empty chunks as rows (rank, request, offset in the request's tokens, length),
    rank-major and, within a rank, in local order: chunks with context, then chunks at position 0."""
    chunk_req = np.repeat(split_rows, 2)  # (2S,)
    at_zero = c[chunk_req] + off == 0  # (P, 2S)
    # Non-empty chunks in columns [with context | at position 0]: reading this rank-major
    # (P, 4S) table in order lists every rank's chunk rows in local order, with no sort.
    keep = np.concatenate([(length > 0) & ~at_zero, (length > 0) & at_zero], axis=1)  # (P, 4S)
    rank_of, col = np.divmod(keep.ravel().nonzero()[0], max(keep.shape[1], 1))  # (rows_c,)
    col %= max(off.shape[1], 1)  # table column -> chunk column
    return rank_of, chunk_req[col], off[rank_of, col], length[rank_of, col]


_NONE = frozen(np.zeros(0, dtype=np.int64))
_NO_CHUNKS = (_NONE, _NONE, _NONE, _NONE)  # _chunk_rows' answer without split rows


class _OwnRows(NamedTuple):
    """Every rank's own rows (assigned, then chunks), rank-major, in local order."""

    rank: np.ndarray  # (rows_o,) the rank owning each row, sorted
    req: np.ndarray  # (rows_o,) global row
    off: np.ndarray  # (rows_o,) offset of its first token in the request's tokens of the step
    len: np.ndarray  # (rows_o,) tokens


def _own_rows(
    q: np.ndarray,
    c: np.ndarray,
    own_rows: np.ndarray,
    chunks: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    P: int,
) -> _OwnRows:
    """Stage 5: the assigned rows dealt to ranks (``pcp_spread.assign_ranks``) merged with
    the chunk rows of stage 4, each rank's assigned rows first."""
    chunk_rank, chunk_req, chunk_off, chunk_len = chunks
    # A stable sort by rank of [assigned (request order) | chunks (rank-major, local order)]
    # lists every rank's rows in local order.
    own_rank = np.concatenate([assign_ranks(q[own_rows], c[own_rows] + q[own_rows], P), chunk_rank])
    by_rank = own_rank.argsort(kind="stable")
    zeros = np.zeros(len(own_rows), dtype=np.int64)
    own_req, own_off, own_len = (
        np.concatenate(pair)[by_rank] for pair in ((own_rows, chunk_req), (zeros, chunk_off), (q[own_rows], chunk_len))
    )
    return _OwnRows(own_rank[by_rank], own_req, own_off, own_len)


class _RowTable(NamedTuple):
    """The layout's row table and every rank's token count."""

    req: np.ndarray  # (rows,) global row: replicated rows, then own rows rank-major
    off: np.ndarray  # (rows,) offset of the row's first token in its request's tokens of the step
    len: np.ndarray  # (rows,) tokens
    rank_row_start: np.ndarray  # (P+1,) where each rank's own rows start in the table
    num_replicated_tokens: int  # T_rep: the replicated rows' tokens, on every rank
    per_rank: np.ndarray  # (P,) int64: tokens of each rank, replicated ones included
    num_tokens_padded: int  # n: the most tokens of any rank


def _row_table(q: np.ndarray, rep_rows: np.ndarray, own: _OwnRows, P: int) -> _RowTable:
    """Stage 6: the row table, replicated rows (shared by all ranks), then own rows rank-major."""
    Rr = len(rep_rows)
    T_rep = int(q[rep_rows].sum())
    per_rank = T_rep + np.bincount(own.rank, weights=own.len, minlength=P).astype(np.int64)
    return _RowTable(
        req=np.concatenate([rep_rows, own.req]),
        off=np.concatenate([np.zeros(Rr, dtype=np.int64), own.off]),
        len=np.concatenate([q[rep_rows], own.len]),
        rank_row_start=Rr + exclusive_cumsum(np.bincount(own.rank, minlength=P)),
        num_replicated_tokens=T_rep,
        per_rank=per_rank,
        num_tokens_padded=int(per_rank.max()),
    )


def _token_maps(qsl: np.ndarray, table: _RowTable, P: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stage 7: the index maps over the gathered space: padded_gather_idx (P*n,),
    kv_write_mask (P*n,) and hidden_restore_idx (T,) (see PCPLayout)."""
    T_rep, n = table.num_replicated_tokens, table.num_tokens_padded
    # Every rank's local tokens: the replicated tokens (same slots on every rank), then its
    # own tokens; the row table's tokens, in order, are exactly that.
    tok = ragged_arange(qsl[table.req] + table.off, table.len)  # (T_rep + T_own,)
    j = np.arange(n)
    kv_write_mask = (j >= T_rep) & (j < table.per_rank[:, None])  # (P, n) own tokens...
    own_slots = kv_write_mask.ravel().nonzero()[0]  # (T_own,)
    kv_write_mask[0, :T_rep] = True  # ...and rank 0's copy of the replicated tokens
    padded_gather_idx = np.zeros((P, n), dtype=np.int64)
    padded_gather_idx[:, :T_rep] = tok[:T_rep]
    padded_gather_idx.ravel()[own_slots] = tok[T_rep:]
    hidden_restore_idx = np.empty(int(qsl[-1]), dtype=np.int64)  # (T,) authoritative = written copy
    hidden_restore_idx[tok[:T_rep]] = j[:T_rep]
    hidden_restore_idx[tok[T_rep:]] = own_slots
    return padded_gather_idx.reshape(-1), kv_write_mask.reshape(-1), hidden_restore_idx
