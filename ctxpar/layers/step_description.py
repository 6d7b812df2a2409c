"""One step as the model runner hands it to attention, and where its tokens sit.

``StepDescription`` is the runner's whole say in a step's attention metadata
(as vLLM's CommonAttentionMetadata): the plan's rows, the PCP layout, and this
rank's place. ``AttentionMetadataBuilder`` (attention_metadata.py) turns it
into the ``ForwardContext`` the layers read; nothing else about a step reaches
them.

Tokens are numbered in global order t = 0..T-1: row r owns
[query_start_loc[r], query_start_loc[r+1]), and its token j sits at absolute
position num_computed_tokens[r] + j. A place ``j`` in a row's cache is slot
``table[j // block_size] * block_size + j % block_size``: the place is the
position, or under DCP the token's index among those its owner stores
(ctxpar/parallel/dcp_shard.py). The functions are pure numpy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ctxpar.parallel.dcp_shard import DCPShard
from ctxpar.parallel.pcp_layout import PCPLayout, RankRows

Collective = Callable[[torch.Tensor], torch.Tensor]  # one of the PCP group's, on this rank's tensor


@dataclass(frozen=True)
class StepDescription:
    """One step on one rank, as attention needs it. Everything but ``rank``,
    ``shard`` and the collectives is the same on every rank. The arrays derived
    from it are worked out on first use, once per step: a rank that only waits
    (a led step's others) never pays for them before it must."""

    num_scheduled_tokens: np.ndarray  # (R,) int64 q_r
    num_computed_tokens: np.ndarray  # (R,) int64 c_r: tokens already in the KV cache
    # (R,) int64 each row's prompt length: a query at a prompt position attends in the
    # prefill kernel, any other (a generated token, a draft) in the decode kernel.
    prompt_lens: np.ndarray
    block_tables: list[np.ndarray]  # R x (blocks_r,) int64 KV block ids of each row
    block_size: int
    layout: PCPLayout  # the step over the ranks (ctxpar/parallel/pcp.py), identical on all
    rank: int
    shard: DCPShard | None  # under DCP, which of the KV this rank stores; None: the whole cache
    all_gather: Collective | None  # over the PCP group, (n, ...) -> (P*n, ...); None on one rank
    all_to_all: Collective | None  # over the PCP group, (P, m, ...) -> (P, m, ...); None on one rank

    @property
    def num_tokens(self) -> int:
        return self.layout.num_tokens

    @property
    def gathers(self) -> bool:
        """Some row split or assigned: each attention layer all-gathers the step's KV entries."""
        return self.layout.pcp_size > 1 and not self.layout.is_all_replicated

    @cached_property
    def rows(self) -> RankRows:
        """This rank's local rows and (padded) tokens."""
        return self.layout.rank_rows(self.rank)

    @cached_property
    def tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """(T,) row and (T,) absolute position of every token of the step."""
        return token_rows_positions(self.num_scheduled_tokens, self.num_computed_tokens)

    @cached_property
    def slots(self) -> np.ndarray:
        """(T,) each token's slot in a whole cache (its place is its position)."""
        row, pos = self.tokens
        return token_slots(self.block_tables, row, pos, self.block_size)


def token_rows_positions(num_scheduled: np.ndarray, num_computed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(T,) row and (T,) absolute position of every token scheduled in the step."""
    q = np.asarray(num_scheduled, dtype=np.int64)
    row = np.repeat(np.arange(len(q)), q)  # (T,)
    qsl = np.concatenate(([0], np.cumsum(q)))
    return row, np.asarray(num_computed, dtype=np.int64)[row] + np.arange(len(row)) - qsl[row]


def padded_block_tables(block_tables: Sequence[np.ndarray]) -> np.ndarray:
    """(R, max_blocks) block tables, zero-padded."""
    width = max((len(b) for b in block_tables), default=0)
    tables = np.zeros((len(block_tables), width), dtype=np.int64)
    for r, b in enumerate(block_tables):
        tables[r, : len(b)] = b
    return tables


def token_slots(
    block_tables: Sequence[np.ndarray], token_row: np.ndarray, where: np.ndarray, block_size: int
) -> np.ndarray:
    """(T,) cache slot of each token, given its row and its place ``where`` in
    that row's cache: block ``where // block_size`` of the row's table, offset
    ``where % block_size``."""
    tables = padded_block_tables(block_tables)  # (R, max_blocks)
    return tables[token_row, where // block_size] * block_size + where % block_size


def slots_of(block_table: np.ndarray, places: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slot of each place of one row. block_table: (B,), places: (m,) -> (m,) int64."""
    return block_table[places // block_size] * block_size + places % block_size
