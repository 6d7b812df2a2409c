"""N-gram (prompt lookup) drafting, vectorised over the batch.

For each sequence (prompt + output so far), find the longest n in
[min_n, max_n] whose last n tokens occurred earlier in the sequence, and
propose the (up to) k tokens that followed its latest occurrence (the latest
one with k tokens after it, if any). No
model runs: the drafts cost a few numpy comparisons per step, and on text
that repeats (code edits, quoting a document, summaries) they are often right.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PAD = -1  # never a token id, so it matches nothing


def right_aligned(seqs: Sequence[Sequence[int]]) -> np.ndarray:
    """(B, L) int64: each sequence at the right end of its row, PAD before it (L = the longest)."""
    lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    width = int(lens.max()) if len(seqs) else 0
    out = np.full((len(seqs), width), PAD, dtype=np.int64)
    if width:
        flat = np.fromiter((t for s in seqs for t in s), dtype=np.int64, count=int(lens.sum()))
        rows = np.repeat(np.arange(len(seqs)), lens)
        cols = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens) + np.repeat(width - lens, lens)
        out[rows, cols] = flat
    return out


def _argmax_rev(a: np.ndarray) -> np.ndarray:
    """(B,) per row of (B, w) bools: how far from the right end its last True is (0 if none)."""
    return a[:, ::-1].argmax(axis=1) if a.shape[1] else np.zeros(a.shape[0], dtype=np.int64)


def propose_ngram(seqs: Sequence[Sequence[int]], k: int, min_n: int, max_n: int) -> list[list[int]]:
    """Up to ``k`` draft tokens per sequence (an empty list where nothing matches)."""
    toks = right_aligned(seqs)  # (B, L)
    batch, width = toks.shape
    drafts: list[list[int]] = [[] for _ in range(batch)]
    todo = np.ones(batch, dtype=bool)  # rows without a match yet
    for n in range(min(max_n, width - 1), min_n - 1, -1):
        w = width - n  # candidate starts 0..w-1; start w is the suffix itself
        match = np.ones((batch, w), dtype=bool)  # (B, w)
        for j in range(n):
            match &= toks[:, j : j + w] == toks[:, width - n + j, None]
        # A suffix that reaches into the padding (a sequence shorter than n + 1) has PAD in it:
        # PAD never equals a token, but it equals PAD, so such rows are excluded.
        match &= (toks[:, width - n - 1] != PAD)[:, None]
        found = todo & match.any(axis=1)
        if not found.any():
            continue
        # The latest occurrence followed by k known tokens (what came after the text's most
        # recent use of the n-gram), else the latest one: a shorter draft.
        # Starts 0..full-1 have k tokens after them: search from the right, those first.
        full = max(0, min(w, width - n - k + 1))
        latest = np.where(
            match[:, :full].any(axis=1), full - 1 - _argmax_rev(match[:, :full]), w - 1 - _argmax_rev(match)
        )
        start = latest + n  # (B,) where each row's draft starts
        for b in np.flatnonzero(found).tolist():
            drafts[b] = toks[b, start[b] : start[b] + k].tolist()
        todo &= ~found
        if not todo.any():
            break
    return drafts
