"""The runner's index arithmetic of a step: pure numpy functions of the
StepPlan's arrays (no torch, no ranks), like the layout planner. Where the
step's tokens sit in the cache is attention's (ctxpar/layers/step_description.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# ctxpar bench overhead times the slot arithmetic under its former names here.
from ctxpar.layers.step_description import token_rows_positions as token_rows_positions
from ctxpar.layers.step_description import token_slots as token_slots


def check_block_tables(block_tables: Sequence[np.ndarray], needed: np.ndarray, block_size: int, num_blocks: int) -> int:
    """Raise ValueError unless every row's slots lie in the cache: its block ids
    in [0, num_blocks), and its table holding at least ``needed[r]`` slots (the
    places in its cache that the step reads or writes). Every slot of a step is
    a table's block times block_size plus an offset below block_size, so this
    bounds them all; the C++ kernels index the cache with them unchecked, so the
    runner checks once per step, before any kernel, in a few vectorized ops.
    Returns the highest block id a table names (-1: none)."""
    lengths = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    short = np.flatnonzero(lengths * block_size < needed)
    if len(short):
        r = int(short[0])
        raise ValueError(
            f"step plan: row {r}'s block table holds {lengths[r] * block_size} slots, the step uses {needed[r]}"
        )
    if not lengths.any():
        return -1
    ids = np.concatenate(block_tables)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"step plan: block ids must be integers, got {ids.dtype}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_blocks:
        raise ValueError(f"step plan: block id {lo if lo < 0 else hi} outside the KV cache's {num_blocks} blocks")
    return hi


def rank_order(owner: np.ndarray, num_ranks: int) -> tuple[np.ndarray, int]:
    """For items each held by rank ``owner[i]``, listed in global order: each
    item's index in its owner's own list, and the longest list (at least 1),
    which every rank pads its list to so a collective has equal shapes."""
    owner = np.asarray(owner, dtype=np.int64)
    counts = np.bincount(owner, minlength=num_ranks)
    starts = np.concatenate(([0], np.cumsum(counts)))[:-1]
    order = np.argsort(owner, kind="stable")  # items grouped by owner, global order within each
    index = np.empty_like(owner)
    index[order] = np.arange(len(owner)) - np.repeat(starts, counts)
    return index, max(int(counts.max(initial=0)), 1)
