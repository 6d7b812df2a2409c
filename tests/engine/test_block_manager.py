"""BlockManager: allocation, growth, freeing, the accounting invariant, and
prefix caching (hash chains, shared reference-counted blocks, LRU eviction)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxpar.engine.block_manager import BlockManager, extend_block_hashes, hash_block


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
    bm = BlockManager(num_blocks, block_size, enable_caching=False)
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


# -- prefix caching ------------------------------------------------------------


def chain(tokens: list[int], block_size: int) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, block_size)
    return hashes


def test_hash_chain_covers_the_whole_prefix():
    a = chain([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(a) == 3  # the partial last block is not hashed
    assert chain([1, 2, 3, 4, 5, 6], 2) == a
    b = chain([9, 9, 3, 4, 5, 6], 2)
    assert b[1] != a[1] and b[2] != a[2]  # equal blocks after different prefixes differ
    grown = a[:1]
    extend_block_hashes(grown, [3, 4, 5, 6, 7], 2)  # continue from block 1
    assert grown == a
    assert hash_block(None, [1, 2]) == a[0] and hash_block(a[0], [3, 4]) == a[1]


def test_hit_shares_blocks_and_freed_blocks_stay_cached():
    bm = BlockManager(num_blocks=6, block_size=2)
    seq = [1, 2, 3, 4, 5]
    h = chain(seq, 2)
    table = list(bm.allocate("a", 5))
    bm.cache_blocks("a", h, 2)  # blocks 0 and 1 computed
    hit = bm.cached_prefix(chain([1, 2, 3, 4, 8, 8], 2))
    assert hit == table[:2]
    assert bm.can_allocate("b", 6, hit) and bm.num_new_blocks("b", 6, hit) == 1  # shared while "a" runs
    assert bm.allocate("b", 6, hit)[:2] == table[:2]
    assert bm.num_free_blocks == 2
    bm.check_integrity()
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 2
    bm.check_integrity()
    # Unreferenced cached blocks leave the pool when hit again.
    assert bm.num_new_blocks("c", 5, hit) == 3 and bm.allocate("c", 5, hit)[:2] == table[:2]
    assert bm.num_free_blocks == 3
    bm.check_integrity()


def test_lru_eviction_and_last_blocks_first():
    bm = BlockManager(num_blocks=4, block_size=1)
    ha, hb = chain([1, 2], 1), chain([7, 8], 1)
    ta, tb = list(bm.allocate("a", 2)), list(bm.allocate("b", 2))
    bm.cache_blocks("a", ha, 2)
    bm.cache_blocks("b", hb, 2)
    bm.free("a")  # "a" is the least recently used
    bm.free("b")
    bm.allocate("c", 1)  # evicts a's last block first: its first block still hits
    assert bm.cached_prefix(ha) == ta[:1] and bm.cached_prefix(hb) == tb
    bm.allocate("c", 3)
    assert bm.cached_prefix(ha) == [] and bm.cached_prefix(hb) == tb[:1]
    assert bm.num_cached_blocks == 1 and bm.num_evictions == 3
    bm.check_integrity()


@pytest.mark.parametrize("enable_caching", [False, True])
def test_blocks_without_a_hash_are_reused_first(enable_caching: bool):
    """A freed block that holds no hash (caching off, or a partial last block) goes back
    first, before the pool's untouched blocks and its cached ones: one request after
    another keeps writing the same few blocks, warm memory, and evicts no cached prefix."""
    bm = BlockManager(num_blocks=64, block_size=4, enable_caching=enable_caching)
    cached = list(bm.allocate("cached", 8))
    bm.cache_blocks("cached", chain(list(range(8)), 4), 2)
    bm.free("cached")  # its two blocks stay in the pool with their hashes
    first = list(bm.allocate("r0", 10))  # 2 full blocks and a partial one
    bm.free("r0")
    for i in range(1, 20):
        table = list(bm.allocate(f"r{i}", 10))  # never registered: no hashes
        assert table == first  # the same blocks, in the same order
        bm.free(f"r{i}")
    assert bm.num_evictions == 0 and bm.cached_prefix(chain(list(range(8)), 4)) == (cached if enable_caching else [])
    bm.check_integrity()


def test_duplicate_prefix_stays_private_and_disabled_caches_nothing():
    bm = BlockManager(num_blocks=4, block_size=2)
    h = chain([1, 2], 2)
    ta, _ = list(bm.allocate("a", 2)), list(bm.allocate("b", 2))
    bm.cache_blocks("a", h, 1)
    bm.cache_blocks("b", h, 1)  # computed at the same time: the first one wins
    assert bm.cached_prefix(h) == ta and bm.num_cached_blocks == 1
    bm.check_integrity()
    off = BlockManager(num_blocks=4, block_size=2, enable_caching=False)
    off.allocate("a", 2)
    off.cache_blocks("a", h, 1)
    assert off.cached_prefix(h) == [] and off.num_cached_blocks == 0


def test_integrity_detects_a_wrong_reference_count():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 3)
    bm._ref[bm.block_table("a")[0]] += 1
    with pytest.raises(AssertionError, match="reference"):
        bm.check_integrity()


cache_ops = st.lists(
    st.tuples(st.sampled_from(["admit", "compute", "free"]), st.integers(0, 3), st.integers(0, 7)),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 10), block_size=st.integers(1, 3), ops=cache_ops, seed=st.integers(0, 3))
def test_random_admit_hit_compute_free_evict(num_blocks, block_size, ops, seed):
    """A model of the engine over a shadow KV cache: every slot records the
    token written to it. Prompts are prefixes of two seeded base sequences
    plus a random tail, so they share prefixes often. A hit must hand over blocks whose every slot holds the
    requester's own tokens; a block is written only while nobody else holds
    it; the accounting holds after every operation."""
    rng = random.Random(seed)
    bases = [[rng.randint(0, 1) for _ in range(10)] for _ in range(2)]
    seqs = [
        bases[i % 2][: rng.randint(1, 10)] + [rng.randint(0, 1) for _ in range(rng.randint(0, 3))] for i in range(8)
    ]
    bm = BlockManager(num_blocks, block_size)
    shadow: dict[int, int] = {}  # slot -> token written there
    live: dict[int, tuple[list[int], int]] = {}  # owner -> (tokens, computed)
    for op, owner, k in ops:
        if op == "admit" and owner not in live:
            seq = seqs[k]
            hashes = chain(seq, block_size)
            hit = bm.cached_prefix(hashes[: (len(seq) - 1) // block_size])
            for i, block in enumerate(hit):
                got = [shadow.get(block * block_size + j) for j in range(block_size)]
                assert got == seq[i * block_size : (i + 1) * block_size], "a hit served someone else's KV"
            if bm.can_allocate(owner, len(seq), hit):
                bm.allocate(owner, len(seq), hit)
                live[owner] = (seq, len(hit) * block_size)
            else:
                free_before = bm.num_free_blocks
                with pytest.raises(RuntimeError):
                    bm.allocate(owner, len(seq), hit)
                assert bm.num_free_blocks == free_before and bm.block_table(owner) == []
        elif op == "compute" and owner in live:
            seq, done = live[owner]
            table = bm.block_table(owner)
            end = min(len(seq), done + k + 1)
            for pos in range(done, end):
                block = table[pos // block_size]
                assert bm._ref[block] == 1, "writing a block another owner holds"
                shadow[block * block_size + pos % block_size] = seq[pos]
            live[owner] = (seq, end)
            bm.cache_blocks(owner, chain(seq, block_size), end // block_size)
        elif op == "free":
            bm.free(owner)
            live.pop(owner, None)
        bm.check_integrity()
        in_use = {b for o in bm.owners() for b in bm.block_table(o)}
        assert len(in_use) + bm.num_free_blocks == num_blocks
