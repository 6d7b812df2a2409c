"""Groups of ranks for the split rows of a step: which ranks each long prompt goes over.

The layout (ctxpar/parallel/pcp.py) splits a row over any contiguous group of
ranks ``[first, first + width)``. Three ways to form the groups of a step's S
split rows over P ranks, each a pure function of the rows' estimated work
(seconds on one rank), so every rank derives the same groups:

- ``all``: every row over all P ranks (DualChunkSwap over the whole group);
- ``whole``: every row on one rank (width 1), rows dealt longest first to the
  least loaded rank, so with S < P some ranks get nothing;
- ``disjoint``: the ranks shared out among the rows: with S >= P as ``whole``,
  with S < P each row gets a group of its own, sized by its share of the work.

Which one a step uses is the policy's choice (ctxpar/costmodel/policy.py).
"""

from __future__ import annotations

import heapq

import numpy as np

from ctxpar.config import PCP_SPLIT_MODES

SPLIT_MODES = PCP_SPLIT_MODES[1:]  # "auto" is the policy's: it picks one of these


def split_groups(mode: str, work: np.ndarray, pcp_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(first, width), each (S,) int64: the group of ranks of each of S split rows."""
    S, P = len(work), pcp_size
    if mode == "all":
        return np.zeros(S, dtype=np.int64), np.full(S, P, dtype=np.int64)
    if mode == "whole" or (mode == "disjoint" and S >= P):
        return _longest_first(work, P), np.ones(S, dtype=np.int64)
    if mode == "disjoint":
        width = _shares(work, P)
        return np.cumsum(width) - width, width
    raise ValueError(f"split mode must be one of {SPLIT_MODES}, got {mode!r}")


def _longest_first(work: np.ndarray, pcp_size: int) -> np.ndarray:
    """(S,) rank of each row: longest first, each to the least loaded rank (ties: the
    highest rank, as pcp_spread's dealing, since rank 0 also computes the logits).
    A loop over the step's split rows, a handful: one heap push and pop each."""
    loads = [(0.0, -k) for k in range(pcp_size)]
    heapq.heapify(loads)
    ranks = np.empty(len(work), dtype=np.int64)
    for r in np.argsort(-work, kind="stable"):
        load, k = heapq.heappop(loads)
        ranks[r] = -k
        heapq.heappush(loads, (load + float(work[r]), k))
    return ranks


def _shares(work: np.ndarray, pcp_size: int) -> np.ndarray:
    """(S,) ranks per row for S < P rows: one each, the other P - S by largest
    remainder of their share of the work (ties: the earlier row)."""
    total = float(work.sum())
    ideal = pcp_size * work / total if total > 0 else np.full(len(work), pcp_size / len(work))
    width = np.maximum(np.floor(ideal).astype(np.int64), 1)
    while width.sum() > pcp_size:  # rows rounded up to one rank took more than their share
        width[np.argmax(np.where(width > 1, width - ideal, -np.inf))] -= 1
    extra = np.argsort(-(ideal - width), kind="stable")[: pcp_size - width.sum()]
    width[extra] += 1
    return width
