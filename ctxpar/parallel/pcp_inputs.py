"""Checks of the planner's inputs (ctxpar/parallel/pcp.py): shapes, dtypes and ranges."""

from __future__ import annotations

import numpy as np


def validate_inputs(
    num_scheduled_tokens: np.ndarray,
    num_computed_tokens: np.ndarray,
    is_prefilling: np.ndarray,
    pcp_size: int,
    replicate_below: int,
    spread_min_rows: int | None,
    split_ranks: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check the inputs; return them as (int64, int64, bool) arrays."""
    arrays = [np.asarray(a) for a in (num_scheduled_tokens, num_computed_tokens, is_prefilling)]
    names = ("num_scheduled_tokens", "num_computed_tokens", "is_prefilling")
    for name, a in zip(names, arrays):
        if a.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    q, c, prefilling = arrays
    if not len(q) == len(c) == len(prefilling):
        raise ValueError(f"length mismatch: {', '.join(f'{k}={len(a)}' for k, a in zip(names, arrays))}")
    if len(q) == 0:
        raise ValueError("empty batch: need at least one row")
    for name, a in zip(names, arrays):
        if a.dtype.kind not in "biu":
            raise ValueError(f"{name} must hold integers or bools, got dtype {a.dtype}")
    if not isinstance(pcp_size, (int, np.integer)) or pcp_size < 1:
        raise ValueError(f"pcp_size must be an integer >= 1, got {pcp_size!r}")
    if replicate_below < 0:
        raise ValueError(f"replicate_below must be >= 0, got {replicate_below}")
    if spread_min_rows is not None and spread_min_rows < 0:
        raise ValueError(f"spread_min_rows must be >= 0 or None, got {spread_min_rows}")
    if q.min() < 0 or c.min() < 0:
        raise ValueError("num_scheduled_tokens and num_computed_tokens must be >= 0")
    if not q.any():
        raise ValueError("no tokens scheduled: every row has num_scheduled_tokens == 0")
    if split_ranks is not None:
        _check_split_ranks(split_ranks, len(q), pcp_size)
    return q.astype(np.int64, copy=False), c.astype(np.int64, copy=False), prefilling.astype(bool, copy=False)


def _check_split_ranks(split_ranks: tuple[np.ndarray, np.ndarray], rows: int, pcp_size: int) -> None:
    """(first, width), each (R,) int: every row's group of ranks lies within [0, P)."""
    first, width = (np.asarray(a) for a in split_ranks)
    if first.shape != (rows,) or width.shape != (rows,) or first.dtype.kind not in "iu" or width.dtype.kind not in "iu":
        raise ValueError(f"split_ranks must be two integer arrays of shape ({rows},)")
    if first.min() < 0 or width.min() < 1 or (first + width).max() > pcp_size:
        raise ValueError(f"split_ranks: every group [first, first + width) must lie in [0, {pcp_size}), width >= 1")
