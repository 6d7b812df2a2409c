"""Spreading rows that are not split: which rank computes each, and when it pays.

A row too short to split (a decode, or a prompt below ``pcp_min_tokens``) is
either *replicated* (every rank computes it; only rank 0's copy counts) or
*assigned* to one rank. Replicating costs every rank the whole row; assigning
costs one rank the row plus, for the step, the KV all-gather of every
attention layer and the gather of the sampled hidden states to rank 0. A step
that already splits a row makes those collectives anyway, so there assigning
is free; a step of unsplit rows only pays once it has enough rows for the
saved compute to outweigh the collectives' latency (docs/benchmarks.md).

Both functions are pure and deterministic, so every rank derives the same
layout from the same plan.
"""

from __future__ import annotations

import numpy as np


def spreads(num_unsplit_rows: int, any_split: bool, pcp_size: int, min_rows: int | None) -> bool:
    """Whether this step assigns its unsplit rows (True) or replicates them.

    ``min_rows`` None never spreads (decode context parallelism needs decode
    queries on every rank: each attends its own shard of the context).
    """
    if min_rows is None or pcp_size == 1 or num_unsplit_rows == 0:
        return False
    return any_split or num_unsplit_rows >= min_rows


def assign_ranks(num_tokens: np.ndarray, seq_lens: np.ndarray, pcp_size: int) -> np.ndarray:
    """(A,) rank of each of A rows: balanced by tokens, then by context length.

    Rows sorted by (tokens, seq_len), largest first, are dealt out round-robin
    from rank P-1 down to rank 0. Each lap gives every rank one row and the
    laps' ranges of keys do not overlap, so per-rank totals differ by at most
    the largest row (in tokens; in context within rows of equal tokens), and
    rank 0, which also computes the logits of every sampled row, never gets
    more rows than another. Vectorised, like the planner: no loop over rows.
    """
    order = np.lexsort((-seq_lens, -num_tokens))  # stable: ties keep request order
    ranks = np.empty(len(order), dtype=np.int64)
    ranks[order] = pcp_size - 1 - np.arange(len(order)) % pcp_size
    return ranks
