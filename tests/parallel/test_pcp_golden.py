"""Golden PCP layouts, each derived by hand in the comment above its expected arrays.

Conventions (see ctxpar/parallel/pcp.py): a split row of q tokens is cut into 2P
chunks; chunk i has q // 2P tokens plus one if i < q mod 2P. Rank k owns chunks
k and 2P-1-k; rank P-1's two chunks touch and form one row. A rank's rows are
replicated rows, then chunks with start position > 0, then chunks at position
0. Gathered slot of rank k's local token j: k*n + j.
"""

from __future__ import annotations

import numpy as np

from ctxpar.parallel.pcp import plan_pcp_layout
from ctxpar.parallel.pcp_layout import PCPLayout


def plan(q: list[int], c: list[int], pre: list[bool], P: int) -> PCPLayout:
    return plan_pcp_layout(np.array(q), np.array(c), np.array(pre), P)


def check(
    layout: PCPLayout,
    gather: list[int],
    write: list[bool],
    restore: list[int],
    ranks: list[dict[str, list[int]]],
) -> None:
    """Compare the index maps and, per rank, rows (req, start, num, seq) and token positions."""
    np.testing.assert_array_equal(layout.padded_gather_idx, gather)
    np.testing.assert_array_equal(layout.kv_write_mask, write)
    np.testing.assert_array_equal(layout.hidden_restore_idx, restore)
    n = layout.num_tokens_padded
    assert len(gather) == layout.pcp_size * n
    for k, want in enumerate(ranks):
        rows = layout.rank_rows(k)
        np.testing.assert_array_equal(rows.req_idx, want["req"])
        np.testing.assert_array_equal(rows.start_pos, want["start"])
        np.testing.assert_array_equal(rows.num_tokens, want["num"])
        np.testing.assert_array_equal(rows.seq_lens, want["seq"])
        np.testing.assert_array_equal(rows.query_start_loc, np.concatenate([[0], np.cumsum(want["num"])]))
        real = sum(want["num"])
        np.testing.assert_array_equal(rows.positions, want["pos"] + [0] * (n - real))
        np.testing.assert_array_equal(rows.token_idx, gather[k * n : (k + 1) * n])
        np.testing.assert_array_equal(rows.is_padding, [False] * real + [True] * (n - real))
        assert layout.per_rank_num_tokens[k] == real


def test_p2_two_fresh_8_token_prompts() -> None:
    # Row 0 owns flat tokens 0..7, row 1 owns 8..15. 2P = 4 chunks of 2:
    # [0,2) [2,4) [4,6) [6,8).
    # Rank 0: chunks 0 and 3. Context group first: (req 0, pos 6), (req 1, pos 6),
    #   then position-0 group: (req 0, pos 0), (req 1, pos 0).
    #   Tokens: 6 7 | 14 15 | 0 1 | 8 9  -> 8 tokens.
    # Rank 1: chunks 1+2 merged = [2,6): (req 0, pos 2, 4), (req 1, pos 2, 4).
    #   Tokens: 2 3 4 5 | 10 11 12 13  -> 8 tokens. n = 8, no padding.
    # Restore: token t sits at the slot where it appears in the gather list above.
    layout = plan([8, 8], [0, 0], [True, True], 2)
    check(
        layout,
        gather=[6, 7, 14, 15, 0, 1, 8, 9, 2, 3, 4, 5, 10, 11, 12, 13],
        write=[True] * 16,
        restore=[4, 5, 8, 9, 10, 11, 0, 1, 6, 7, 12, 13, 14, 15, 2, 3],
        ranks=[
            dict(
                req=[0, 1, 0, 1], start=[6, 6, 0, 0], num=[2, 2, 2, 2], seq=[8, 8, 2, 2], pos=[6, 7, 6, 7, 0, 1, 0, 1]
            ),
            dict(req=[0, 1], start=[2, 2], num=[4, 4], seq=[6, 6], pos=[2, 3, 4, 5, 2, 3, 4, 5]),
        ],
    )
    assert not layout.is_all_replicated


def test_p4_one_fresh_16_token_prompt() -> None:
    # 2P = 8 chunks of 2: chunk i = [2i, 2i+2). Rank k owns chunks k and 7-k.
    # Rank 0: chunk 7 [14,16) (context) before chunk 0 [0,2) (position 0): 14 15 0 1.
    # Rank 1: chunks 1 [2,4) and 6 [12,14), both with context, by position: 2 3 12 13.
    # Rank 2: chunks 2 [4,6) and 5 [10,12): 4 5 10 11.
    # Rank 3: chunks 3 and 4 touch -> one row [6,10): 6 7 8 9. n = 4.
    layout = plan([16], [0], [True], 4)
    check(
        layout,
        gather=[14, 15, 0, 1, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9],
        write=[True] * 16,
        restore=[2, 3, 4, 5, 8, 9, 12, 13, 14, 15, 10, 11, 6, 7, 0, 1],
        ranks=[
            dict(req=[0, 0], start=[14, 0], num=[2, 2], seq=[16, 2], pos=[14, 15, 0, 1]),
            dict(req=[0, 0], start=[2, 12], num=[2, 2], seq=[4, 14], pos=[2, 3, 12, 13]),
            dict(req=[0, 0], start=[4, 10], num=[2, 2], seq=[6, 12], pos=[4, 5, 10, 11]),
            dict(req=[0], start=[6], num=[4], seq=[10], pos=[6, 7, 8, 9]),
        ],
    )


def test_p2_decode_plus_fresh_8_token_prompt() -> None:
    # Row 0: a decode at position 5 (5 cached), flat token 0, replicated.
    # Row 1: fresh 8-token prompt, flat tokens 1..8; chunks of 2 at offsets 0, 2, 4, 6.
    # Rank 0: decode (flat 0), then chunk 3 (pos 6: flat 7 8), then chunk 0 (pos 0: flat 1 2).
    # Rank 1: decode (flat 0), then chunks 1+2 merged (pos 2..5: flat 3 4 5 6). n = 5.
    # Only rank 0's copy of the decode writes KV: slot 5 (rank 1's copy) is masked.
    # Restore: 0->0, 1->3, 2->4, 3->6, 4->7, 5->8, 6->9, 7->1, 8->2.
    layout = plan([1, 8], [5, 0], [False, True], 2)
    check(
        layout,
        gather=[0, 7, 8, 1, 2, 0, 3, 4, 5, 6],
        write=[True] * 5 + [False] + [True] * 4,
        restore=[0, 3, 4, 6, 7, 8, 9, 1, 2],
        ranks=[
            dict(req=[0, 1, 1], start=[5, 6, 0], num=[1, 2, 2], seq=[6, 8, 2], pos=[5, 6, 7, 0, 1]),
            dict(req=[0, 1], start=[5, 2], num=[1, 4], seq=[6, 6], pos=[5, 2, 3, 4, 5]),
        ],
    )
    np.testing.assert_array_equal(layout.rank_rows(0).is_replicated, [True, False, False])
    np.testing.assert_array_equal(layout.rank_rows(1).is_replicated, [True, False])


def test_p2_8_new_tokens_after_100_cached() -> None:
    # Chunks of 2 at offsets 0, 2, 4, 6 -> positions 100, 102, 104, 106.
    # Rank 0: chunks 0 and 3, both start > 0, so global (position) order:
    #   (pos 100: flat 0 1), (pos 106: flat 6 7).
    # Rank 1: chunks 1+2 merged: pos 102..105, flat 2 3 4 5. n = 4.
    layout = plan([8], [100], [True], 2)
    check(
        layout,
        gather=[0, 1, 6, 7, 2, 3, 4, 5],
        write=[True] * 8,
        restore=[0, 1, 4, 5, 6, 7, 2, 3],
        ranks=[
            dict(req=[0, 0], start=[100, 106], num=[2, 2], seq=[102, 108], pos=[100, 101, 106, 107]),
            dict(req=[0], start=[102], num=[4], seq=[106], pos=[102, 103, 104, 105]),
        ],
    )


def test_p4_fresh_3_token_prompt_leaves_a_rank_empty() -> None:
    # q = 3 < 2P = 8: base 0, remainder 3, so chunks 0, 1, 2 have one token each
    # (offsets 0, 1, 2) and chunks 3..7 are empty.
    # Rank 0: chunk 0 (flat 0); rank 1: chunk 1 (flat 1); rank 2: chunk 2 (flat 2);
    # rank 3: chunks 3, 4 empty -> the zero-token row (req 0, start 0, 0 tokens, seq 0).
    # n = 1; rank 3's single slot is padding: gathered 0, not written.
    layout = plan([3], [0], [True], 4)
    check(
        layout,
        gather=[0, 1, 2, 0],
        write=[True, True, True, False],
        restore=[0, 1, 2],
        ranks=[
            dict(req=[0], start=[0], num=[1], seq=[1], pos=[0]),
            dict(req=[0], start=[1], num=[1], seq=[2], pos=[1]),
            dict(req=[0], start=[2], num=[1], seq=[3], pos=[2]),
            dict(req=[0], start=[0], num=[0], seq=[0], pos=[]),
        ],
    )
    np.testing.assert_array_equal(layout.rank_rows(3).is_replicated, [False])


def test_p2_three_decodes_are_replicated() -> None:
    # No prefill: every rank computes all three decodes (flat 0 1 2) at positions
    # 10, 20, 30. n = 3; only rank 0's copies write; restore reads rank 0's slots.
    layout = plan([1, 1, 1], [10, 20, 30], [False, False, False], 2)
    decodes = dict(req=[0, 1, 2], start=[10, 20, 30], num=[1, 1, 1], seq=[11, 21, 31], pos=[10, 20, 30])
    check(
        layout,
        gather=[0, 1, 2, 0, 1, 2],
        write=[True, True, True, False, False, False],
        restore=[0, 1, 2],
        ranks=[decodes, decodes],
    )
    assert layout.is_all_replicated


def test_p2_fresh_10_token_prompt_balances_5_5() -> None:
    # q = 10, 2P = 4: base 2, remainder 2 -> chunk lengths 3, 3, 2, 2 at offsets 0, 3, 6, 8.
    # Rank 0: chunks 0 and 3; context first: (pos 8, 2 tokens: 8 9), then (pos 0, 3: 0 1 2).
    # Rank 1: chunks 1+2 merged: [3, 8), 5 tokens. 5/5 (the reference's ceil(10/4) = 3
    # gives chunks 3, 3, 3, 1 and a 4/6 split).
    layout = plan([10], [0], [True], 2)
    check(
        layout,
        gather=[8, 9, 0, 1, 2, 3, 4, 5, 6, 7],
        write=[True] * 10,
        restore=[2, 3, 4, 5, 6, 7, 8, 9, 0, 1],
        ranks=[
            dict(req=[0, 0], start=[8, 0], num=[2, 3], seq=[10, 3], pos=[8, 9, 0, 1, 2]),
            dict(req=[0], start=[3], num=[5], seq=[8], pos=[3, 4, 5, 6, 7]),
        ],
    )


def test_p2_decodes_assigned_beside_a_split_prompt() -> None:
    # The example of pcp.py's docstring. Row 0: a fresh 10-token prompt, flat tokens 0..9,
    # chunks of 3, 3, 2, 2: [0,3) [3,6) [6,8) [8,10). Rows 1-3: decodes after 9, 7 and 3
    # cached tokens (flat 10, 11, 12). The step splits a row, so its decodes are assigned:
    # by falling seq_len (10, 8, 4) round-robin from rank 1: row 1 -> 1, row 2 -> 0, row 3 -> 1.
    # Rank 0: row 2 (11), chunk 3 with context (8 9), chunk 0 at position 0 (0 1 2); 6 tokens.
    # Rank 1: rows 1 and 3 (10, 12), chunks 1+2 as one row (3..7); 7 tokens. n = 7.
    # Every real slot is written (each token has one copy); restore: slot of each token.
    layout = plan_pcp_layout(
        np.array([10, 1, 1, 1]), np.array([0, 9, 7, 3]), np.array([True, False, False, False]), 2, spread_min_rows=4
    )
    check(
        layout,
        gather=[11, 8, 9, 0, 1, 2, 0, 10, 12, 3, 4, 5, 6, 7],
        write=[True] * 6 + [False] + [True] * 7,
        restore=[3, 4, 5, 9, 10, 11, 12, 13, 1, 2, 7, 0, 8],
        ranks=[
            dict(req=[2, 0, 0], start=[7, 8, 0], num=[1, 2, 3], seq=[8, 10, 3], pos=[7, 8, 9, 0, 1, 2]),
            dict(req=[1, 3, 0], start=[9, 3, 3], num=[1, 1, 5], seq=[10, 4, 8], pos=[9, 3, 3, 4, 5, 6, 7]),
        ],
    )
    np.testing.assert_array_equal(layout.is_assigned, [False, True, True, True])
    # Without a split row, three decodes are too few to spread at spread_min_rows=4...
    assert plan_pcp_layout(
        np.ones(3, int), np.array([9, 7, 3]), np.zeros(3, bool), 2, spread_min_rows=4
    ).is_all_replicated
    # ...and enough at 3.
    assert plan_pcp_layout(
        np.ones(3, int), np.array([9, 7, 3]), np.zeros(3, bool), 2, spread_min_rows=3
    ).is_assigned.all()
