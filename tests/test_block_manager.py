"""BlockManager: allocation, growth, freeing, and the partition invariant."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxpar.engine.block_manager import BlockManager


def test_allocate_grow_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.blocks_for(0) == 0 and bm.blocks_for(1) == 1 and bm.blocks_for(4) == 1 and bm.blocks_for(5) == 2
    t = bm.allocate("a", 5)
    assert len(t) == 2 and bm.num_free_blocks == 6
    assert bm.allocate("a", 8) == t and len(t) == 2  # still fits
    bm.allocate("a", 9)
    assert len(bm.block_table("a")) == 3
    assert bm.can_allocate("b", 20) and not bm.can_allocate("b", 21)
    assert bm.max_coverable_tokens("a") == 8 * 4
    bm.check_integrity()
    assert bm.free("a") == 3 and bm.num_free_blocks == 8
    assert bm.block_table("a") == []
    bm.check_integrity()


def test_out_of_blocks_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate("a", 4)
    with pytest.raises(RuntimeError):
        bm.allocate("b", 8)
    assert bm.block_table("b") == [] and bm.num_free_blocks == 1
    bm.check_integrity()


def test_slots_are_distinct_across_owners():
    bm = BlockManager(num_blocks=16, block_size=4)
    lens = {"a": 7, "b": 13, "c": 1}
    slots = set()
    for owner, n in lens.items():
        table = bm.allocate(owner, n)
        for p in range(n):
            slots.add(table[p // 4] * 4 + p % 4)
    assert len(slots) == sum(lens.values())


def test_integrity_detects_corruption():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 3)
    bm._tables["a"].append(bm._tables["a"][0])  # a duplicate
    with pytest.raises(AssertionError):
        bm.check_integrity()


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "grow", "free"]), st.integers(0, 5), st.integers(1, 40)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 12), block_size=st.integers(1, 5), ops=ops)
def test_random_sequences_keep_the_partition(num_blocks, block_size, ops):
    bm = BlockManager(num_blocks, block_size)
    lengths: dict[int, int] = {}
    for op, owner, n in ops:
        if op == "free":
            bm.free(owner)
            lengths.pop(owner, None)
        else:
            target = n if op == "alloc" else lengths.get(owner, 0) + n
            target = max(target, lengths.get(owner, 0))
            if bm.can_allocate(owner, target):
                bm.allocate(owner, target)
                lengths[owner] = target
            else:
                free_before = bm.num_free_blocks
                with pytest.raises(RuntimeError):
                    bm.allocate(owner, target)
                assert bm.num_free_blocks == free_before
        bm.check_integrity()
        for o, length in lengths.items():
            assert len(bm.block_table(o)) == bm.blocks_for(length)  # exactly enough, never more
        owned = sum(len(bm.block_table(o)) for o in bm.owners())
        assert owned + bm.num_free_blocks == num_blocks
