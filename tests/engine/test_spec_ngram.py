"""N-gram drafts: the vectorised batch search equals a plain per-sequence search."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ctxpar.engine.spec_decode.ngram import propose_ngram


def naive(seq: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix n-gram (max_n down to min_n) seen earlier; the k tokens after its
    latest occurrence that has k tokens after it, else after its latest occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if len(seq) < n + 1:
            continue
        suffix = seq[-n:]
        starts = [i for i in range(len(seq) - n) if seq[i : i + n] == suffix]
        if starts:
            full = [i for i in starts if i + n + k <= len(seq)]
            start = (full or starts)[-1] + n
            return seq[start : start + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=40), min_size=1, max_size=6),
    st.integers(1, 5),
    st.integers(1, 4),
    st.integers(0, 3),
)
def test_batch_search_equals_the_plain_search(seqs, k, min_n, extra):
    max_n = min_n + extra
    assert propose_ngram(seqs, k, min_n, max_n) == [naive(s, k, min_n, max_n) for s in seqs]


def test_copying_a_passage_drafts_its_continuation():
    doc = list(range(100, 160))
    seq = [1, *doc, 2, 3, *doc[:10]]  # a prompt holding the passage, then the output copying it
    assert propose_ngram([seq, [5]], 4, 2, 5) == [doc[10:14], []]
