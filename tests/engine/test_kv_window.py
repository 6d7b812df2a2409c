"""The blocks a sliding window lets the block manager free (ctxpar/engine/kv_window.py) are
never read again: every slot that any later step's attention reads, as its own metadata
builders say (one rank and each PCP rank: attention_metadata.py, paged.py's prompt spans and
decode groups; each DCP shard: dcp_metadata.py), lies in a block the bound keeps. And the
block manager's accounting with blocks given back mid-sequence: tables, pool, prefix cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ctxpar.engine.block_manager import BlockManager, extend_block_hashes
from ctxpar.engine.kv_window import KVWindow, freeing_window
from ctxpar.layers.attention.paged import decode_batch, prompt_spans, window_keys
from ctxpar.layers.attention_metadata import AttentionMetadataBuilder
from ctxpar.layers.dcp_metadata import _queries
from ctxpar.layers.step_description import StepDescription
from ctxpar.model_args import from_config_json
from ctxpar.parallel.dcp_shard import DCPShard
from ctxpar.parallel.pcp import plan_pcp_layout

CPU = torch.device("cpu")


def step_of(c: int, q: int, prompt_len: int, block_size: int, ranks: int, rank: int, shard: DCPShard | None):
    """One row of q tokens after c computed ones, over a table naming block i for its i-th entry
    (so a slot's block is its index), as ``rank`` of ``ranks`` sees it."""
    blocks = -(-(c + q) // block_size) + 1
    args = (np.array([q]), np.array([c]), np.array([prompt_len > c]))
    return StepDescription(
        num_scheduled_tokens=args[0],
        num_computed_tokens=args[1],
        prompt_lens=np.array([prompt_len]),
        block_tables=[np.arange(blocks, dtype=np.int64)],
        block_size=block_size,
        layout=plan_pcp_layout(*args, ranks),
        rank=rank,
        shard=shard,
        all_gather=None,
        all_to_all=None,
    )


def slots_read(step: StepDescription, window: int) -> list[torch.Tensor]:
    """Every cache slot the step's attention reads on its rank, from the metadata the layers get:
    a prompt span's keys from its window's aligned run on (window_keys), a decode row's last
    ``window`` slots (the paged decode kernel's), a DCP shard's spans and decode rows whole."""
    if step.shard is not None:
        to_dev = lambda a: torch.as_tensor(a, dtype=torch.int64)
        prompt, generated, decodes = _queries(step, to_dev, window)
        return [s.slots for s in prompt + generated] + ([decodes.slots] if decodes is not None else [])
    ctx = AttentionMetadataBuilder([], None, CPU).build(step)
    reads = []
    for kernel in (True, False):  # the kernels' grouping and PyTorch's
        dec = decode_batch(ctx, kernel)
        reads += [window_keys(slots, b - a, window) for a, b, slots in prompt_spans(ctx, dec)]
        for grp in dec.groups if dec is not None else []:
            reads += [grp.slots[s:e][-window:] for s, e in zip(grp.starts[:-1].tolist(), grp.starts[1:].tolist())]
    return reads


@settings(max_examples=300, deadline=None)
@given(
    window=st.integers(1, 400),
    c=st.integers(0, 1500),
    later=st.integers(0, 300),
    q=st.integers(1, 300),
    prompt_extra=st.integers(-400, 400),
    block_pow=st.integers(0, 5),
    ranks=st.sampled_from([1, 2, 4]),
    dcp=st.booleans(),
    interleave_pow=st.integers(0, 5),
    rank=st.integers(0, 3),
)
# A DCP rank holding no key of the query's window reads from the run before its first place.
@example(window=1, c=256, later=0, q=1, prompt_extra=9, block_pow=4, ranks=2, dcp=True, interleave_pow=0, rank=1)
def test_no_later_read_touches_a_freed_block(
    window, c, later, q, prompt_extra, block_pow, ranks, dcp, interleave_pow, rank
) -> None:
    """A sequence with c tokens computed frees ``unread_blocks(c)``; any later step (its first
    query at c + later, prompt positions or generated ones, any chunk) reads none of them, on
    any rank, with or without DCP."""
    phys = 2**block_pow  # slots per block on a rank
    dcp_size = ranks if dcp else 1
    interleave = min(2**interleave_pow, phys)
    freed = KVWindow(window, dcp_size, interleave).unread_blocks(c, phys * dcp_size)
    start = c + later
    rank %= ranks
    shard = DCPShard(dcp_size, interleave, rank) if dcp else None
    step = step_of(start, q, max(0, start + prompt_extra), phys, ranks, rank, shard)
    for slots in slots_read(step, window):
        if len(slots):
            assert int(slots.min()) // phys >= freed


def test_a_long_sequence_frees_all_but_its_window_and_an_aligned_run() -> None:
    """What the bound gives: at c = 1000, w = 24, blocks of 16, the first key a query sees is
    977, in the run [896, 1024): the 56 blocks before it go; under DCP over 2 ranks (blocks of
    32 positions, 16 on a rank), each rank holds 488 places before 977: the run [384, 512) of
    places, 24 blocks."""
    assert KVWindow(24).unread_blocks(1000, 16) == 56
    assert KVWindow(24, dcp_size=2, interleave=4).unread_blocks(1000, 32) == 24
    assert KVWindow(24).unread_blocks(150, 16) == 0  # the first run is always read


def test_only_a_model_windowed_at_every_layer_frees() -> None:
    """The one rule: every layer windowed (Mistral v0.1) and no draft model on the tables."""
    common = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64, vocab_size=99)
    mistral = from_config_json(dict(common, model_type="mistral", sliding_window=24))
    qwen = from_config_json(
        dict(common, model_type="qwen2", use_sliding_window=True, sliding_window=24, max_window_layers=1)
    )
    llama = from_config_json(dict(common, model_type="llama"))
    assert freeing_window(mistral, has_draft=False) == 24
    assert freeing_window(mistral, has_draft=True) is None  # a draft model reads the tables at its own positions
    assert freeing_window(qwen, has_draft=False) is None  # layer 0 attends every key
    assert freeing_window(llama, has_draft=False) is None


def test_freed_entries_name_the_null_block_and_come_back_to_the_pool() -> None:
    bm = BlockManager(num_blocks=20, block_size=16, window=KVWindow(24))
    assert bm.num_blocks == 19 and bm.null_block == 19 and bm.num_free_blocks == 19
    table = bm.allocate("a", 300)  # 19 blocks: the whole pool
    assert bm.free_unread("a", 100) == 0  # the first key, 77, is in the run [0, 128)
    assert bm.free_unread("a", 200) == 8 and bm.num_free_blocks == 8  # 177: blocks 0-7 go
    assert bm.free_unread("a", 290) == 8 and bm.num_free_blocks == 16  # 267, in [256, 384): blocks 8-15 go
    assert table[:16] == [19] * 16 and bm.num_live_blocks("a") == 3
    assert bm.free_unread("a", 290) == 0  # given back once
    bm.check_integrity()
    assert bm.allocate("b", 100) and bm.num_free_blocks == 9
    with pytest.raises(ValueError):
        bm.truncate("a", 100)  # the window's blocks are behind it
    assert bm.free("a") == 3 and bm.num_free_blocks == 12  # its live blocks
    bm.check_integrity()


def test_a_prefix_hit_needs_only_the_blocks_its_first_step_reads_intact() -> None:
    """Offered before it is freed (the scheduler's order), a block the window gives back keeps
    its hash in the pool. A lookup offers the blocks a table starting there reads (from the
    aligned run of its first window on), and those only must be intact: evicting the chain's
    first block loses nothing, evicting its last shortens the hit to where the rest are."""
    bs = 16
    bm = BlockManager(num_blocks=30, block_size=bs, window=KVWindow(8))
    null = bm.null_block
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(400)), bs)
    table = list(bm.allocate("a", 400))  # blocks 0-24
    bm.cache_blocks("a", hashes, 25)
    assert bm.free_unread("a", 300) == 16 and bm.num_free_blocks == 4 + 16
    # From 400 on a table reads from 384 (first key 393), from 320 on from 256 (first key 313).
    assert bm.cached_prefix(hashes) == [null] * 24 + table[24:]
    assert bm.cached_prefix(hashes[:20]) == [null] * 16 + table[16:20]
    bm.allocate("b", bs * 5)  # the 4 never used, then the first freed: block 0, the chain's first
    assert bm.num_evictions == 1 and bm.cached_prefix(hashes[:20]) == [null] * 16 + table[16:20]
    bm.free("a")  # blocks 24, 23, ..., 16 join the pool behind 1-15
    bm.allocate("c", bs * 16)  # evicts 1-15 and 24
    assert bm.num_evictions == 17 and bm.cached_prefix(hashes) == [null] * 16 + table[16:24]
    bm.check_integrity()


def test_a_prefix_hit_takes_only_the_blocks_its_first_step_reads() -> None:
    """A request admitted with 24 cached blocks (384 tokens) computes from 384 on: its first
    read starts at the run [256, 384), so the 16 blocks before it stay in the pool, still
    hits for others, and its table starts with 16 null entries."""
    bs = 16
    bm = BlockManager(num_blocks=30, block_size=bs, window=KVWindow(16))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(400)), bs)
    bm.allocate("a", 400)
    bm.cache_blocks("a", hashes, 25)
    bm.free("a")
    cached = bm.cached_prefix(hashes[:24])
    assert len(cached) == 24 and bm.num_new_blocks("b", 400, cached) == 8 + 1
    table = bm.allocate("b", 400, cached)
    assert table[:16] == [bm.null_block] * 16 and table[16:24] == cached[16:] and bm.num_live_blocks("b") == 9
    assert bm.cached_prefix(hashes[:24]) == cached and bm.num_free_blocks == 29 - 9
    bm.check_integrity()


def test_registration_skips_blocks_freed_before_they_were_offered() -> None:
    """cache_blocks never names the null block: an entry freed unoffered is not registered (the
    blocks offered after it still are: a table starting at 320 reads from 256 on)."""
    bs = 16
    bm = BlockManager(num_blocks=30, block_size=bs, window=KVWindow(8))
    tokens = list(range(400))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, bs)
    bm.allocate("a", 400)
    assert bm.free_unread("a", 300) == 16
    bm.cache_blocks("a", hashes, 20)
    assert bm.num_cached_blocks == 4 and bm.cached_prefix(hashes) == [bm.null_block] * 16 + bm.block_table("a")[16:20]
    bm.check_integrity()


ops = st.lists(
    st.tuples(
        st.sampled_from(["grow", "hit", "compute", "truncate", "cache", "free"]), st.integers(0, 3), st.integers(0, 60)
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(window=st.integers(1, 40), block_size=st.sampled_from([1, 2, 4, 8]), num_blocks=st.integers(2, 80), ops=ops)
@example(
    window=4, block_size=4, num_blocks=20, ops=[("grow", 0, 40), ("compute", 0, 40), ("cache", 0, 0), ("hit", 1, 20)]
)
@example(
    window=4, block_size=2, num_blocks=80, ops=[("grow", 0, 60)] * 3 + [("compute", 0, 60)] * 3 + [("cache", 0, 0)]
)
def test_random_steps_keep_the_accounting_and_every_readable_block(window, block_size, num_blocks, ops) -> None:
    """Sequences of one prompt that start (from a prefix hit or not), grow, compute, roll back
    drafts, offer their blocks and finish, with the window freeing what it may: the accounting
    holds, and every block a later read can touch (from ``unread_blocks`` of the computed tokens
    on) is the owner's, never the null block."""
    kv = KVWindow(window)
    bm = BlockManager(num_blocks, block_size, window=kv)
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(4000)), block_size)  # every sequence's tokens
    computed: dict[int, int] = {}
    allocated: dict[int, int] = {}
    for op, owner, n in ops:
        c, have = computed.get(owner, 0), allocated.get(owner, 0)
        if op == "hit" and owner not in computed:
            cached = bm.cached_prefix(hashes[: n // block_size])
            start = len(cached) * block_size
            if bm.can_allocate(owner, start + 1, cached):
                bm.allocate(owner, start + 1, cached)
                computed[owner], allocated[owner] = start, start + 1
        elif op == "grow" and bm.can_allocate(owner, have + n):
            bm.allocate(owner, have + n)
            allocated[owner] = have + n
            computed.setdefault(owner, 0)
        elif op == "compute" and owner in computed:
            computed[owner] = min(have, c + n)
        elif op == "truncate" and owner in computed:
            keep = max(c, have - n)
            bm.truncate(owner, keep)
            allocated[owner] = keep
        elif op == "cache" and owner in computed:
            bm.cache_blocks(owner, hashes, c // block_size)
        elif op == "free" and owner in computed:
            bm.free(owner)
            computed.pop(owner), allocated.pop(owner)
        for o, k in computed.items():
            bm.free_unread(o, k)
            table = bm.block_table(o)
            assert all(b != bm.null_block for b in table[kv.unread_blocks(k, block_size) :])
            assert len(table) == bm.blocks_for(allocated[o])
        bm.check_integrity()
    held = {b for o in computed for b in bm.block_table(o)} - {bm.null_block}
    assert len(held) + bm.num_free_blocks == bm.num_blocks
