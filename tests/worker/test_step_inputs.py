"""ctxpar.worker.step_inputs against per-token loops written from the definitions."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxpar.worker.step_inputs import rank_order


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8).flatmap(lambda p: st.tuples(st.just(p), st.lists(st.integers(0, p - 1), max_size=50))))
def test_rank_order_is_each_items_place_in_its_owners_list(case):
    ranks, owner = case
    index, width = rank_order(np.array(owner, dtype=np.int64), ranks)
    seen = [0] * ranks
    for i, k in enumerate(owner):
        assert index[i] == seen[k]
        seen[k] += 1
    assert width == max(max(seen), 1)
