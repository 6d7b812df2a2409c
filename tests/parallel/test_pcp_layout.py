"""Property tests of the PCP layout planner over random batches (P = 1..8, R <= 64).

Batches mix decodes (1 token, not prefilling, cached context), fresh prefills,
continued prefills (cached context), prefills shorter than 2P, rows with no
tokens, random ``replicate_below`` and ``spread_min_rows`` thresholds, and
split rows over all ranks or each over its own random group of ranks
(``split_ranks``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxpar.bench.planner import loop_plan
from ctxpar.parallel.pcp import plan_pcp_layout
from ctxpar.parallel.pcp_layout import PCPLayout, RankRows

settings.register_profile("pcp", max_examples=60, deadline=None)
settings.load_profile("pcp")


@dataclass(frozen=True)
class Batch:
    q: np.ndarray  # (R,) scheduled tokens
    c: np.ndarray  # (R,) computed (cached) tokens
    pre: np.ndarray  # (R,) prefilling
    P: int
    replicate_below: int
    spread_min_rows: int | None
    split_ranks: tuple[np.ndarray, np.ndarray] | None = None  # (first, width) per row; None: all ranks

    def group(self, r: int) -> tuple[int, int]:
        """(first, width): the ranks split row r goes over."""
        return (0, self.P) if self.split_ranks is None else (int(self.split_ranks[0][r]), int(self.split_ranks[1][r]))

    @property
    def qsl(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.q)])

    @property
    def split(self) -> np.ndarray:  # (R,) rows the spec says to cut into chunks
        return self.pre & (self.q > 0) & (self.q >= self.replicate_below)

    @property
    def assigned(self) -> np.ndarray:  # (R,) unsplit rows the spec says to give to one rank each
        unsplit = ~self.split & (self.q > 0)
        spread = self.spread_min_rows is not None and self.P > 1
        spread = spread and (self.split.any() or unsplit.sum() >= self.spread_min_rows)
        return unsplit & spread

    @property
    def replicated(self) -> np.ndarray:  # (R,)
        return ~self.split & (self.q > 0) & ~self.assigned

    def plan(self) -> PCPLayout:
        return plan_pcp_layout(
            self.q, self.c, self.pre, self.P, self.replicate_below, self.spread_min_rows, self.split_ranks
        )


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    P = draw(st.integers(1, 8))
    context = st.integers(1, 10_000)
    row = st.one_of(
        st.tuples(st.just(1), context, st.just(False)),  # decode
        st.tuples(st.integers(1, 300), st.just(0), st.just(True)),  # fresh prefill
        st.tuples(st.integers(1, 300), context, st.just(True)),  # continued prefill
        st.tuples(st.integers(1, max(1, 2 * P - 1)), st.sampled_from([0, 7]), st.just(True)),  # shorter than 2P
        st.tuples(st.just(0), st.integers(0, 100), st.booleans()),  # no tokens this step
    )
    rows = draw(st.lists(row, min_size=1, max_size=64))
    if sum(q for q, _, _ in rows) == 0:
        rows[0] = (1, 0, True)
    q, c, pre = (np.array(col) for col in zip(*rows))
    replicate_below = draw(st.sampled_from([0, 0, 1, 2 * P, 64]))
    spread_min_rows = draw(st.sampled_from([None, None, 0, 1, 4, 16]))
    split_ranks = None
    if draw(st.booleans()):  # each row over a group [first, first + width) of the ranks
        width = np.array(draw(st.lists(st.integers(1, P), min_size=len(q), max_size=len(q))))
        first = np.array([draw(st.integers(0, P - w)) for w in width])
        split_ranks = first.astype(np.int64), width.astype(np.int64)
    return Batch(
        q.astype(np.int64), c.astype(np.int64), pre.astype(bool), P, replicate_below, spread_min_rows, split_ranks
    )


def all_rows(layout: PCPLayout) -> list[RankRows]:
    return [layout.rank_rows(k) for k in range(layout.pcp_size)]


@given(batches())
def test_restore_inverts_gather(b: Batch) -> None:
    layout = b.plan()
    np.testing.assert_array_equal(layout.padded_gather_idx[layout.hidden_restore_idx], np.arange(b.q.sum()))
    assert layout.kv_write_mask[layout.hidden_restore_idx].all()  # the authoritative copy is the written one


@given(batches())
def test_every_token_written_exactly_once(b: Batch) -> None:
    layout = b.plan()
    written = layout.padded_gather_idx[layout.kv_write_mask]
    np.testing.assert_array_equal(np.bincount(written, minlength=b.q.sum()), np.ones(b.q.sum()))
    assert not (layout.kv_write_mask & layout.gathered_is_padding).any()


@given(batches())
def test_token_counts_and_padding(b: Batch) -> None:
    layout = b.plan()
    n = layout.num_tokens_padded
    assert layout.num_tokens == b.q.sum()
    assert n == layout.per_rank_num_tokens.max() >= 1
    assert layout.padded_gather_idx.shape == layout.kv_write_mask.shape == (b.P * n,)
    for rows in all_rows(layout):
        real = rows.num_tokens.sum()
        assert real == layout.per_rank_num_tokens[rows.rank] == (~rows.is_padding).sum()
        assert not rows.is_padding[:real].any()
        assert (rows.positions[real:] == 0).all() and (rows.token_idx[real:] == 0).all()
        assert rows.num_rows >= 1
    assert layout.is_all_replicated == (not (b.split.any() or b.assigned.any()))
    np.testing.assert_array_equal(layout.is_split, b.split)
    np.testing.assert_array_equal(layout.is_assigned, b.assigned)


@given(batches())
def test_rows_are_contiguous_and_absolute(b: Batch) -> None:
    layout, qsl = b.plan(), b.qsl
    for rows in all_rows(layout):
        np.testing.assert_array_equal(rows.seq_lens, rows.start_pos + rows.num_tokens)
        np.testing.assert_array_equal(rows.query_start_loc, np.concatenate([[0], np.cumsum(rows.num_tokens)]))
        for i, r in enumerate(rows.req_idx):
            if rows.num_tokens[i] == 0:  # the zero-token row of an empty rank
                continue
            offset = rows.start_pos[i] - b.c[r]  # where the row starts within request r's tokens
            assert 0 <= offset and offset + rows.num_tokens[i] <= b.q[r]
            local = slice(rows.query_start_loc[i], rows.query_start_loc[i + 1])
            steps = np.arange(rows.num_tokens[i])
            np.testing.assert_array_equal(rows.positions[local], rows.start_pos[i] + steps)
            np.testing.assert_array_equal(rows.token_idx[local], qsl[r] + offset + steps)


@given(batches())
def test_row_order(b: Batch) -> None:
    """Replicated, assigned, chunks with start_pos > 0, then at 0; each group by (request, position)."""
    layout = b.plan()
    for rows in all_rows(layout):
        assigned = layout.is_assigned[rows.req_idx] & (rows.num_tokens > 0)
        group = np.where(rows.is_replicated, 0, np.where(assigned, 1, np.where(rows.start_pos > 0, 2, 3)))
        assert (np.diff(group) >= 0).all()
        for g in range(4):
            keys = list(zip(rows.req_idx[group == g], rows.start_pos[group == g]))
            assert keys == sorted(set(keys))


@given(batches())
def test_replicated_rows_on_every_rank(b: Batch) -> None:
    replicated = np.flatnonzero(b.replicated)
    for rows in all_rows(b.plan()):
        Rr = len(replicated)
        assert rows.is_replicated[:Rr].all() and not rows.is_replicated[Rr:].any()
        np.testing.assert_array_equal(rows.req_idx[:Rr], replicated)
        np.testing.assert_array_equal(rows.start_pos[:Rr], b.c[replicated])
        np.testing.assert_array_equal(rows.num_tokens[:Rr], b.q[replicated])


@given(batches())
def test_assigned_rows_on_one_rank_balanced(b: Batch) -> None:
    """Each assigned row is one whole row on exactly one rank; per-rank assigned tokens differ
    by at most the longest assigned row, assigned rows per rank by at most one, and rank 0
    (which also computes the logits) never has more rows than another."""
    layout = b.plan()
    owner = np.full(len(b.q), -1)
    tokens, count = np.zeros(b.P, dtype=np.int64), np.zeros(b.P, dtype=np.int64)
    for rows in all_rows(layout):
        for r, start, num in zip(rows.req_idx, rows.start_pos, rows.num_tokens):
            if b.assigned[r] and num > 0:
                assert owner[r] == -1 and start == b.c[r] and num == b.q[r]
                owner[r] = rows.rank
                tokens[rows.rank] += num
                count[rows.rank] += 1
    np.testing.assert_array_equal(owner >= 0, b.assigned)
    if b.assigned.any():
        assert tokens.max() - tokens.min() <= b.q[b.assigned].max()
        assert count.max() - count.min() <= 1 and count[0] == count.min()


@given(batches())
def test_chunk_lengths_differ_by_at_most_one(b: Batch) -> None:
    """A row split over the w ranks [f, f+w) of its group is cut into 2w chunks: on
    ranks f..f+w-2 each is one row, rank f+w-1's single row is two touching chunks,
    and ranks outside the group have none of it.

    All chunks of a row have q // 2w or q // 2w + 1 tokens, longer ones first.
    """
    ranks = all_rows(b.plan())

    def pieces(rows: RankRows, r: int) -> list[tuple[int, int]]:
        mine = (rows.req_idx == r) & ~rows.is_replicated & (rows.num_tokens > 0)
        return list(zip(rows.start_pos[mine], rows.num_tokens[mine]))

    for r in np.flatnonzero(b.split):
        f, w = b.group(r)
        base = b.q[r] // (2 * w)
        assert not any(pieces(ranks[k], r) for k in range(b.P) if not f <= k < f + w)
        lengths = [num for _, num in sorted(p for k in range(f, f + w - 1) for p in pieces(ranks[k], r))]
        assert set(lengths) <= {base, base + 1}
        assert lengths == sorted(lengths, reverse=True)
        merged = [num for _, num in pieces(ranks[f + w - 1], r)]
        assert len(merged) <= 1 and all(2 * base <= m <= 2 * base + 2 for m in merged)


@given(batches())
def test_attention_work_is_balanced(b: Batch) -> None:
    """max - min of per-rank work (sum of position + 1) <= sum over split rows of c + 2q.

    Replicated rows add the same work to every rank, so only split rows matter,
    and the spread of a sum is at most the sum of spreads. For one row of
    q = 2P*b + r tokens (0 <= r < 2P) after c cached: with r = 0 every chunk has
    b tokens and the pairs (k, 2P-1-k) have equal work. Otherwise chunk i starts
    min(i, r) tokens later than in the r = 0 layout and, for i < r, has one extra
    token; summing those changes per rank (relative to a common constant):
      r <  P: ranks k < r get c + b*r + b + 1 + k(2b+1), ranks k >= r get 2br,
              so spread <= max(c + r(b+1) - b, (r-1)(2b+1)) <= c + q;
      r == P: spread = (P-1)(2b+1) < q;
      r >  P: ranks k < 2P-r get b*r + b + k(2b+1), the others c + 4Pb + 2P,
              so spread = c + (4P-r-1)b + 2P <= c + 2q.
    So spread <= c + 2q <= 2(c + q): two tokens at the row's last position,
    which is within one chunk's worth ((b+1)(c+q)) whenever chunks have b >= 1.
    The bound is tight (q = P+1, c = 0 reaches about 1.4q at P = 8).

    Assigned rows are dealt out round-robin sorted by (tokens, context): within
    a run of equal token counts their work w = q*c + q(q+1)/2 falls, so full laps
    add at most w_max - w_min to any spread and the two partial laps at the run's
    ends at most w_max each: 3 * w_max per distinct token count.
    """
    layout = b.plan()
    work = np.array([(rows.positions + 1)[~rows.is_padding].sum() for rows in all_rows(layout)])
    np.testing.assert_array_equal(work, layout.attention_work())
    if b.split_ranks is not None:  # groups of ranks: balanced within each (test_groups_are_balanced)
        return
    q, c = b.q[b.assigned], b.c[b.assigned]
    w = q * c + q * (q + 1) // 2
    bound = (b.c + 2 * b.q)[b.split].sum() + sum(3 * w[q == t].max() for t in set(q.tolist()))
    assert work.max() - work.min() <= bound
    assert np.abs(work - work.mean()).max() <= bound


@given(batches())
def test_groups_are_balanced(b: Batch) -> None:
    """Each split row's attention work over the w ranks of its group differs by at most
    c + 2q (test_attention_work_is_balanced's bound, with w for P), and is 0 elsewhere."""
    work = np.zeros((len(b.q), b.P), dtype=np.int64)  # (R, P): each row's work on each rank
    for rows in all_rows(b.plan()):
        for i, r in enumerate(rows.req_idx):
            if b.split[r]:
                work[r, rows.rank] += (rows.positions[rows.query_start_loc[i] : rows.query_start_loc[i + 1]] + 1).sum()
    for r in np.flatnonzero(b.split):
        f, w = b.group(r)
        group = work[r, f : f + w]
        assert group.sum() == work[r].sum()
        assert group.max() - group.min() <= b.c[r] + 2 * b.q[r]


@given(batches())
def test_matches_the_loop_planner(b: Batch) -> None:
    """Without spreading (the loop planner only replicates unsplit rows)."""
    layout = plan_pcp_layout(b.q, b.c, b.pre, b.P, b.replicate_below)
    loop = loop_plan(b.q, b.c, b.pre, b.P, b.replicate_below)
    np.testing.assert_array_equal(layout.padded_gather_idx, loop.padded_gather_idx)
    np.testing.assert_array_equal(layout.kv_write_mask, loop.kv_write_mask)
    np.testing.assert_array_equal(layout.hidden_restore_idx, loop.hidden_restore_idx)
    for rows, want in zip(all_rows(layout), loop.rank_rows):
        if want:  # the loop planner leaves an empty rank without rows
            assert list(zip(rows.req_idx, rows.start_pos, rows.num_tokens)) == want


def test_arrays_are_read_only() -> None:
    layout = plan_pcp_layout(np.array([8, 1]), np.array([0, 3]), np.array([True, False]), 2)
    with pytest.raises(ValueError, match="read-only"):
        layout.padded_gather_idx[0] = 1
    with pytest.raises(ValueError, match="read-only"):
        layout.rank_rows(1).positions[0] = 1


@pytest.mark.parametrize(
    ("q", "c", "pre", "P", "below", "match"),
    [
        ([1, 2], [0], [True, True], 2, 0, "length mismatch"),
        ([[1, 2]], [[0, 0]], [[True, True]], 2, 0, "1-D"),
        ([1.5], [0], [True], 2, 0, "integers"),
        ([], [], [], 2, 0, "empty batch"),
        ([-1, 4], [0, 0], [True, True], 2, 0, ">= 0"),
        ([4], [-3], [True], 2, 0, ">= 0"),
        ([4], [0], [True], 0, 0, "pcp_size"),
        ([4], [0], [True], 2, -1, "replicate_below"),
        ([4], [0], [True], 2, (0, -1), "spread_min_rows"),
        ([0, 0], [5, 0], [True, False], 2, 0, "no tokens"),
    ],
)
def test_invalid_input_raises(q: list, c: list, pre: list, P: int, below: int | tuple, match: str) -> None:
    """``below``: replicate_below, or (replicate_below, spread_min_rows)."""
    below, spread = below if isinstance(below, tuple) else (below, None)
    with pytest.raises(ValueError, match=match):
        plan_pcp_layout(np.array(q), np.array(c), np.array(pre), P, below, spread)


@pytest.mark.parametrize(
    ("first", "width", "match"),
    [([0], [3], "must lie in"), ([-1], [1], "must lie in"), ([1], [0], "width >= 1"), ([0, 0], [1, 1], "shape")],
)
def test_invalid_split_ranks_raise(first: list, width: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        groups = np.array(first), np.array(width)
        plan_pcp_layout(np.array([4]), np.array([0]), np.array([True]), 2, split_ranks=groups)


def test_rank_out_of_range() -> None:
    layout = plan_pcp_layout(np.array([4]), np.array([0]), np.array([True]), 2)
    with pytest.raises(ValueError, match="rank 2 out of range"):
        layout.rank_rows(2)
