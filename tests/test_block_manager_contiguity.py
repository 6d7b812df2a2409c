"""BlockManager's preference for adjacent blocks: a growing table takes the
block after its last one when that block is free and caches nothing (so decode
attention can read the context in place), without changing the accounting,
the pool's capacity or the LRU order in which cached prefixes are evicted."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from ctxpar.engine.block_manager import BlockManager, extend_block_hashes


def chain(tokens: list[int], block_size: int) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, block_size)
    return hashes


def test_growing_table_takes_the_free_block_after_its_last() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    assert bm.allocate("a", 2) == [0] and bm.allocate("b", 2) == [1] and bm.allocate("c", 2) == [2]
    bm.free("b")  # block 1 goes to the back of the pool
    assert bm.allocate("a", 4) == [0, 1]  # adjacent beats least recently freed (3)
    assert bm.allocate("d", 6) == [3, 4, 5]  # a new table: the pool's order, ascending runs
    bm.check_integrity()


def test_adjacent_cached_block_is_not_taken_out_of_lru_order() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.allocate("a", 2)
    bm.allocate("b", 2)
    h = chain([7, 7], 2)
    bm.cache_blocks("b", h, 1)
    bm.free("b")  # block 1 keeps its prefix in the pool
    assert bm.allocate("a", 4) == [0, 2]  # the front of the pool, no eviction
    assert bm.cached_prefix(h) == [1] and bm.num_evictions == 0
    bm.check_integrity()


ops = st.lists(
    st.tuples(st.sampled_from(["admit", "grow", "compute", "free"]), st.integers(0, 3), st.integers(0, 7)),
    max_size=80,
)


@settings(max_examples=120, deadline=None)
@given(num_blocks=st.integers(1, 12), block_size=st.integers(1, 3), ops=ops, seed=st.integers(0, 3))
def test_random_ops_keep_invariants_and_evict_in_lru_order(num_blocks, block_size, ops, seed) -> None:
    """Random admissions (with prefix hits), growth, registration and frees:
    the accounting holds; an allocation succeeds exactly when enough blocks
    are free; every block it takes is either the adjacent one (free,
    uncached) or the pool's front; the prefixes it evicts are the least
    recently freed cached blocks, in order."""
    rng = random.Random(seed)
    seqs = [[rng.randint(0, 1) for _ in range(rng.randint(1, 12))] for _ in range(8)]
    bm = BlockManager(num_blocks, block_size)
    live: dict[int, list[int]] = {}  # owner -> tokens covered
    for op, owner, k in ops:
        if op == "free":
            bm.free(owner)
            live.pop(owner, None)
            continue
        if op == "compute" and owner in live:
            toks = live[owner]
            bm.cache_blocks(owner, chain(toks, block_size), len(toks) // block_size)
            continue
        if op == "admit" and owner not in live:
            toks, hit = seqs[k], bm.cached_prefix(chain(seqs[k], block_size)[: (len(seqs[k]) - 1) // block_size])
        elif op == "grow" and owner in live:
            toks, hit = live[owner] + [k % 2] * (k + 1), []
        else:
            continue
        free_before = list(bm._free)
        cached_free = [b for b in free_before if bm._hash[b] is not None and b not in hit]
        table_before = list(bm.block_table(owner)) + list(hit)
        fits = bm.num_new_blocks(owner, len(toks), hit) <= len(free_before)
        assert bm.can_allocate(owner, len(toks), hit) == fits
        if not fits:
            continue
        evictions = bm.num_evictions
        table = bm.allocate(owner, len(toks), hit)
        live[owner] = toks
        front = [b for b in free_before if b not in hit]
        for prev, block in zip(table[len(table_before) - 1 :] if table_before else [None] + table, table[len(table_before) :]):
            adjacent = prev is not None and block == prev + 1 and block not in cached_free
            assert adjacent or block == front[0], f"block {block} is neither adjacent nor the pool's front"
            front.remove(block)
        evicted = [b for b in cached_free if bm._hash[b] is None]
        assert evicted == cached_free[: len(evicted)] and bm.num_evictions - evictions == len(evicted)
        bm.check_integrity()
        in_use = {b for o in bm.owners() for b in bm.block_table(o)}
        assert len(in_use) + bm.num_free_blocks == num_blocks
