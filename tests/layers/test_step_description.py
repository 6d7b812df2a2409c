"""ctxpar.layers.step_description's slot arithmetic against per-token loops written
from the definitions."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxpar.layers.step_description import padded_block_tables, slots_of, token_rows_positions, token_slots


@st.composite
def steps(draw):
    rows = draw(st.integers(1, 8))
    q = draw(st.lists(st.integers(0, 40), min_size=rows, max_size=rows))
    c = draw(st.lists(st.integers(0, 100), min_size=rows, max_size=rows))
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    tables = [
        np.array(
            draw(st.lists(st.integers(0, 500), min_size=-(-(ci + qi) // block_size), max_size=150)), dtype=np.int64
        )
        for qi, ci in zip(q, c)
    ]
    return np.array(q), np.array(c), tables, block_size


@settings(max_examples=200, deadline=None)
@given(steps())
def test_rows_positions_and_slots_match_a_loop(step):
    q, c, tables, block_size = step
    row, pos = token_rows_positions(q, c)
    expected_row, expected_pos, expected_slot = [], [], []
    for r in range(len(q)):
        for j in range(q[r]):
            p = c[r] + j
            expected_row.append(r)
            expected_pos.append(p)
            expected_slot.append(tables[r][p // block_size] * block_size + p % block_size)
    assert row.tolist() == expected_row and pos.tolist() == expected_pos
    assert token_slots(tables, row, pos, block_size).tolist() == expected_slot


def test_padded_block_tables():
    t = padded_block_tables([np.array([3, 1]), np.array([], dtype=np.int64), np.array([7, 8, 9])])
    assert t.tolist() == [[3, 1, 0], [0, 0, 0], [7, 8, 9]]


def test_slots_of_a_row_are_its_tokens_slots():
    table, block_size = np.array([5, 2, 9]), 4
    places = np.array([0, 3, 4, 11])
    assert slots_of(table, places, block_size).tolist() == [20, 23, 8, 39]
