"""The attention kernels of ctxpar/layers/attention/torch_ops.py against the
straightforward path: explicit scores, an explicit bottom-right causal mask
and a softmax, one row at a time (fp32, 1e-5), over random shapes, context
lengths, GQA ratios and paged slot layouts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxpar.layers.attention.backend import causal_attention
from ctxpar.layers.attention.torch_ops import (
    decode_attention,
    gather_paged_kv,
    padded_slot_table,
)
from helpers.attention_reference import TOL, reference

shapes = st.fixed_dictionaries(
    dict(
        kv_heads=st.integers(1, 3),
        group=st.sampled_from([1, 2, 3, 4]),
        head_dim=st.sampled_from([8, 16, 24]),
        seed=st.integers(0, 2**16),
    )
)


@settings(max_examples=25, deadline=None)
@given(shape=shapes, lengths=st.lists(st.integers(1, 70), min_size=1, max_size=5), block_size=st.integers(1, 8))
def test_batched_paged_decode_matches_per_row_reference(shape, lengths, block_size) -> None:
    g = torch.Generator().manual_seed(shape["seed"])
    Hk, H, D = shape["kv_heads"], shape["kv_heads"] * shape["group"], shape["head_dim"]
    # A paged cache whose blocks are handed out in a random order, like a used block pool.
    num_blocks = sum(-(-s // block_size) for s in lengths) + 3
    cache = torch.randn(num_blocks * block_size, 2, Hk, D, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    slots = []
    for s in lengths:
        blocks = torch.tensor([free.pop() for _ in range(-(-s // block_size))])
        pos = torch.arange(s)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    q = torch.randn(len(lengths), H, D, generator=g)
    scale = D**-0.5

    table, lens = padded_slot_table(torch.cat(slots), torch.cumsum(torch.tensor([0] + lengths), 0))
    k, v = gather_paged_kv(cache, table)
    out, lse = decode_attention(q, k, v, lens, scale)
    for b, sl in enumerate(slots):
        kv = cache[sl]
        want, want_lse = reference(q[b : b + 1], kv[:, 0], kv[:, 1], scale)
        torch.testing.assert_close(out[b].double(), want[0], **TOL)
        torch.testing.assert_close(lse[b].double(), want_lse[0], **TOL)
        # and the path it replaces: PyTorch's kernel, one call per row
        torch.testing.assert_close(out[b], causal_attention(q[b : b + 1], kv[:, 0], kv[:, 1], scale)[0], **TOL)


def test_decode_row_without_keys_is_zero_not_nan() -> None:
    """An empty key set (an empty DCP shard) gives out 0 and lse -inf, so an LSE merge ignores it."""
    q, k = torch.randn(2, 4, 8), torch.randn(2, 2, 5, 8)
    out, lse = decode_attention(q, k, k, torch.tensor([5, 0]), 0.3)
    assert torch.isfinite(out).all() and (out[1] == 0).all()
    assert torch.isneginf(lse[1]).all() and torch.isfinite(lse[0]).all()


def test_latent_decode_single_shared_head_with_narrower_value() -> None:
    """MLA's absorbed decode: one KV head for all query heads, the value a prefix of the key."""
    g = torch.Generator().manual_seed(1)
    B, H, E, r, S = 3, 4, 24, 16, 9
    q, k = torch.randn(B, H, E, generator=g), torch.randn(B, 1, S, E, generator=g)
    out, lse = decode_attention(q, k, k[..., :r], None, 0.2)
    for b in range(B):
        want, want_lse = reference(q[b : b + 1], k[b, 0][:, None], k[b, 0][:, None, :r], 0.2)
        torch.testing.assert_close(out[b].double(), want[0], **TOL)
        torch.testing.assert_close(lse[b].double(), want_lse[0], **TOL)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "pytorch"])
def test_step_of_mixed_rows_matches_per_row_attention(kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """gqa_paged_attention over a step mixing short decodes, a long decode, a
    verify row (8 queries past the prompt), a prefill chunk, a recomputed row whose
    prompt ends inside it (a lost rank's or a preemption's recompute) and a padding
    token: every row as if it attended alone. With the compiled kernels a query
    takes the decode kernel iff it lies past its prompt, so every decode, the verify
    row and the recomputed row's generated tokens share one call; the prompt
    queries attend in the prefill kernel. The PyTorch path batches the short
    decodes in length groups and attends the rest one by one."""
    monkeypatch.setenv("CTXPAR_KERNELS", "1" if kernel else "0")
    from ctxpar.layers.attention.backend import AttentionSpec
    from ctxpar.layers.attention.paged import DECODE_BATCH_MAX_KEYS, decode_batch, gqa_paged_attention
    from ctxpar.layers.forward_context import ForwardContext

    g = torch.Generator().manual_seed(7)
    Hk, H, D = 2, 6, 16
    cache = torch.randn(4096, 2, Hk, D, generator=g)
    perm = torch.randperm(4096, generator=g)
    # Row 5: 8 queries after 32 cached; row 6: 20 prompt queries after 30 cached; row 7:
    # 50 queries from 0 whose prompt is the first 35.
    seq_lens = [5, 6, 90, 100, DECODE_BATCH_MAX_KEYS + 50, 40, 50, 50]
    num_tokens = [1, 1, 1, 1, 1, 8, 20, 50]
    prompt_lens = [4, 3, 50, 99, 7, 32, 50, 35]
    qsl = [0]
    for t in num_tokens:
        qsl.append(qsl[-1] + t)
    starts = torch.cumsum(torch.tensor([0] + seq_lens), 0)
    slots = [perm[starts[r] : starts[r + 1]] for r in range(len(seq_lens))]
    ctx = ForwardContext(
        query_start_loc=qsl,
        start_pos=[s - t for s, t in zip(seq_lens, num_tokens)],
        seq_lens=seq_lens,
        context_slots=slots,
        write_src=None,
        write_slots=torch.empty(0, dtype=torch.int64),
        kv_caches=[cache],
        prompt_lens=prompt_lens,
    )
    n = qsl[-1] + 1  # one padding token
    q = torch.randn(n, H, D, generator=g)
    out = gqa_paged_attention(q, cache, ctx, AttentionSpec(0.3))
    dec = decode_batch(ctx, kernel)
    if kernel:  # by position: prompt queries to the prefill kernel, the rest in one decode call
        assert dec.prompt_queries == [0, 0, 0, 0, 0, 0, 20, 35] and len(dec.groups) == 1
    else:  # long decode and the rest one by one
        assert dec.prompt_queries == [0, 0, 0, 0, 1, 8, 20, 50] and len(dec.groups) == 2
    for r in range(len(seq_lens)):
        kv = cache[slots[r]]
        want, _ = reference(q[qsl[r] : qsl[r + 1]], kv[:, 0], kv[:, 1], 0.3)
        torch.testing.assert_close(out[qsl[r] : qsl[r + 1]].double(), want, **TOL)
    assert (out[qsl[-1] :] == 0).all()


def fragmented_free_list(num_blocks: int, max_piece: int, g: torch.Generator) -> list[int]:
    """Block ids as a used pool hands them out: pieces of consecutive ids of
    random sizes, in random order, some descending (a freed table's order)."""
    pieces, start = [], 0
    while start < num_blocks:
        size = int(torch.randint(1, max_piece + 1, (), generator=g))
        piece = list(range(start, min(start + size, num_blocks)))
        pieces.append(piece[::-1] if torch.rand((), generator=g) < 0.3 else piece)
        start += size
    return [b for i in torch.randperm(len(pieces), generator=g).tolist() for b in pieces[i]]


@settings(max_examples=25, deadline=None)
@given(
    shape=shapes,
    rows=st.lists(st.tuples(st.integers(1, 300), st.sampled_from([1, 1, 1, 3])), min_size=1, max_size=5),
    block_size=st.sampled_from([1, 4, 16]),
    max_piece=st.sampled_from([1, 3, 40]),
)
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "pytorch"])
def test_step_over_fragmented_or_contiguous_pool_matches_reference(
    kernel: bool, shape, rows, block_size, max_piece
) -> None:
    """gqa_paged_attention over a step of decodes, prefill chunks and a padding
    token, on block tables from a pool that is contiguous, fragmented or in
    between, with the compiled kernel and on the PyTorch path: every row as if
    it attended alone."""
    from ctxpar.layers.attention.backend import AttentionSpec
    from ctxpar.layers.attention.paged import gqa_paged_attention
    from ctxpar.layers.forward_context import ForwardContext

    g = torch.Generator().manual_seed(shape["seed"])
    Hk, H, D = shape["kv_heads"], shape["kv_heads"] * shape["group"], shape["head_dim"]
    seq_lens, num_tokens = [max(s, t) for s, t in rows], [t for _, t in rows]
    free = fragmented_free_list(sum(-(-s // block_size) for s in seq_lens) + 4, max_piece, g)
    cache = torch.randn(len(free) * block_size, 2, Hk, D, generator=g)
    qsl, slots = [0], []
    for s, t in zip(seq_lens, num_tokens):
        blocks = torch.tensor([free.pop(0) for _ in range(-(-s // block_size))])
        pos = torch.arange(s)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        qsl.append(qsl[-1] + t)
    ctx = ForwardContext(
        query_start_loc=qsl,
        start_pos=[s - t for s, t in zip(seq_lens, num_tokens)],
        seq_lens=seq_lens,
        context_slots=slots,
        write_src=None,
        write_slots=torch.empty(0, dtype=torch.int64),
        kv_caches=[cache],
    )
    q = torch.randn(qsl[-1] + 1, H, D, generator=g)
    with pytest.MonkeyPatch.context() as mp:  # hypothesis reruns the body: no function-scoped fixture
        mp.setenv("CTXPAR_KERNELS", "1" if kernel else "0")
        out = gqa_paged_attention(q, cache, ctx, AttentionSpec(D**-0.5))
    for r, sl in enumerate(slots):
        kv = cache[sl]
        want, _ = reference(q[qsl[r] : qsl[r + 1]], kv[:, 0], kv[:, 1], D**-0.5)
        torch.testing.assert_close(out[qsl[r] : qsl[r + 1]].double(), want, **TOL)
    assert (out[qsl[-1] :] == 0).all()


@settings(max_examples=25, deadline=None)
@given(shape=shapes, new=st.integers(1, 40), context=st.integers(0, 60))
def test_lower_right_sdpa_the_gpu_path_of_causal_attention(shape, new, context) -> None:
    """causal_attention off the CPU (``lower_right_sdpa``: PyTorch's bottom-right causal
    mask, GQA), here on the CPU: continued prefills, single queries and whole prompts."""
    from ctxpar.layers.attention.torch_ops import lower_right_sdpa

    g = torch.Generator().manual_seed(shape["seed"])
    Hk, H, D = shape["kv_heads"], shape["kv_heads"] * shape["group"], shape["head_dim"]
    S = new + context
    q, k, v = (
        torch.randn(new, H, D, generator=g),
        torch.randn(S, Hk, D, generator=g),
        torch.randn(S, Hk, D, generator=g),
    )
    heads = lambda t: t.transpose(0, 1).unsqueeze(0)  # (1, heads, len, D), as causal_attention passes them
    out = lower_right_sdpa(heads(q), heads(k), heads(v), D**-0.5)[0].transpose(0, 1)
    torch.testing.assert_close(out.double(), reference(q, k, v, D**-0.5)[0], **TOL)
