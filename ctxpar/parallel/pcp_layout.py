"""A PCP layout: the rows and tokens each of P ranks computes in one step, and the index
maps that gather, write and restore them (planned by ctxpar/parallel/pcp.py).

Every rank pads its tokens to n = max over ranks, so collectives have equal
shapes. The "gathered space" has P*n slots, rank k's local token j at k*n + j.
Example, P = 2: pcp.py's prompt of 10 tokens (chunks c0..c3, c = 0) and decodes D0, D1,
D2 of falling context length, dealt to ranks 1, 0, 1 (``w``: the slots
``kv_write_mask`` writes; n = 7)::

    gathered:  | rank 0: n slots          | rank 1: n slots          |
               | D1 c3 c3 c0 c0 c0 pad    | D0 D2 c1 c1 c1 c2 c2     |
    writes:    | w  w  w  w  w  w         | w  w  w  w  w  w  w      |

With the decodes replicated instead, each rank's slots would start with
D0 D1 D2, written only on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True, eq=False)
class RankRows:
    """One rank's local batch: its rows and its n (padded) tokens.

    A rank with no tokens gets a single zero-token row (req_idx 0, start_pos 0,
    num_tokens 0, seq_len 0): it attends to nothing and reads no cache, but
    keeps "at least one row" true for kernels and the model runner.
    """

    rank: int
    req_idx: np.ndarray  # (rows,) int64: global row of each local row
    start_pos: np.ndarray  # (rows,) int64: absolute position of the row's first token
    num_tokens: np.ndarray  # (rows,) int64
    seq_lens: np.ndarray  # (rows,) int64: start_pos + num_tokens (keys attended)
    query_start_loc: np.ndarray  # (rows + 1,) int64: exclusive prefix sum of num_tokens
    is_replicated: np.ndarray  # (rows,) bool: row computed by every rank
    positions: np.ndarray  # (n,) int64: absolute position per local token, 0 on padding
    token_idx: np.ndarray  # (n,) int64: global flat token per local token, 0 on padding
    is_padding: np.ndarray  # (n,) bool

    @property
    def num_rows(self) -> int:
        return len(self.req_idx)


@dataclass(frozen=True, eq=False)
class PCPLayout:
    """The layout of one step over P ranks. Arrays are read-only.

    Index maps over the gathered space (P*n slots, rank k's token j at k*n + j):
    ``padded_gather_idx`` (global flat token at each slot, 0 on padding),
    ``kv_write_mask`` (slot writes KV: split and assigned tokens, and
    replicated tokens on rank 0 only, so each global token is written exactly
    once) and
    ``hidden_restore_idx`` (slot of the authoritative copy of each global token,
    so ``gathered[hidden_restore_idx]`` is in global order).

    Local rows live in one flat table (``row_*``): first the
    ``num_replicated_rows`` replicated rows, shared by every rank, then each
    rank's own (assigned and chunk) rows, rank-major and in local order. Rank k's rows are the replicated
    rows followed by ``row_*[rank_row_start[k]:rank_row_start[k+1]]``;
    ``rank_rows(k)`` assembles them with that rank's tokens.
    """

    pcp_size: int
    num_tokens: int  # T: scheduled tokens of the step
    num_tokens_padded: int  # n: max tokens on any rank
    per_rank_num_tokens: np.ndarray  # (P,) int64
    padded_gather_idx: np.ndarray  # (P*n,) int64
    kv_write_mask: np.ndarray  # (P*n,) bool
    hidden_restore_idx: np.ndarray  # (T,) int64
    is_split: np.ndarray  # (R,) bool: row cut into chunks
    is_assigned: np.ndarray  # (R,) bool: row computed by one rank (neither: replicated, or no tokens)
    num_replicated_rows: int
    rank_row_start: np.ndarray  # (P+1,) int64, into the row table
    row_req_idx: np.ndarray  # (rows,) int64: global row
    row_start_pos: np.ndarray  # (rows,) int64: absolute position of the first token
    row_num_tokens: np.ndarray  # (rows,) int64

    @property
    def is_all_replicated(self) -> bool:
        """No row was split or assigned: the step needs no KV all-gather and no restore."""
        return not (self.is_split.any() or self.is_assigned.any())

    @cached_property
    def gathered_is_padding(self) -> np.ndarray:  # (P*n,) bool
        n = self.num_tokens_padded
        return frozen((np.arange(n) >= self.per_rank_num_tokens[:, None]).reshape(-1))

    @cached_property
    def gathered_positions(self) -> np.ndarray:  # (P*n,) int64, 0 on padding
        return frozen(np.concatenate([self.rank_rows(k).positions for k in range(self.pcp_size)]))

    def attention_work(self) -> np.ndarray:  # (P,) int64
        """Causal attention work per rank: sum of (position + 1) over its real tokens."""
        work = np.where(self.gathered_is_padding, 0, self.gathered_positions + 1)
        return work.reshape(self.pcp_size, -1).sum(axis=1)

    def rank_rows(self, rank: int) -> RankRows:
        """The local rows and tokens of ``rank`` (cheap: O(rows + n) of that rank)."""
        if not 0 <= rank < self.pcp_size:
            raise ValueError(f"rank {rank} out of range for pcp_size {self.pcp_size}")
        Rr, lo, hi = self.num_replicated_rows, self.rank_row_start[rank], self.rank_row_start[rank + 1]
        table = (self.row_req_idx, self.row_start_pos, self.row_num_tokens)
        req_idx, start_pos, num_tokens = (np.concatenate([a[:Rr], a[lo:hi]]) for a in table)
        if len(req_idx) == 0:  # the zero-token row of an empty rank
            req_idx, start_pos, num_tokens = (np.zeros(1, dtype=np.int64) for _ in range(3))
        n, real = self.num_tokens_padded, int(self.per_rank_num_tokens[rank])
        positions = np.zeros(n, dtype=np.int64)
        positions[:real] = ragged_arange(start_pos, num_tokens)
        return RankRows(
            rank=rank,
            req_idx=frozen(req_idx),
            start_pos=frozen(start_pos),
            num_tokens=frozen(num_tokens),
            seq_lens=frozen(start_pos + num_tokens),
            query_start_loc=frozen(exclusive_cumsum(num_tokens)),
            is_replicated=frozen(np.arange(len(req_idx)) < Rr),
            positions=frozen(positions),
            token_idx=self.padded_gather_idx[rank * n : (rank + 1) * n],
            is_padding=frozen(np.arange(n) >= real),
        )


# Small helpers called several times per step; ndarray methods skip numpy's Python wrappers.
def exclusive_cumsum(a: np.ndarray) -> np.ndarray:  # (len(a) + 1,)
    out = np.zeros(len(a) + 1, dtype=np.int64)
    a.cumsum(out=out[1:])
    return out


def ragged_arange(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:  # (sum(lengths),)
    """concat(arange(s, s + l) for s, l in zip(starts, lengths)), without a Python loop."""
    offsets = exclusive_cumsum(lengths)
    return (starts - offsets[:-1]).repeat(lengths) + np.arange(offsets[-1])


def frozen(a: np.ndarray) -> np.ndarray:
    # The layout is shared by the whole step; a stray in-place edit would desynchronise ranks.
    a.setflags(write=False)
    return a
