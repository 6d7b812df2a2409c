"""Which of a sequence's KV blocks the kernels can still read when every attention layer of
the model has a sliding window, so the block manager (block_manager.py) can free the rest.

A query at position p sees the keys at (p - w, p]. Every query of a sequence's later steps is
at a position >= c, its computed tokens (a decode, a prompt chunk, a verify row's drafts: a
rejected draft's position is computed again, never one below c; a preempted sequence frees
all its blocks and recomputes). What each reads of its row's cache:

- a decode row reads its last w slots (ctxpar/layers/attention/paged.py);
- a prompt chunk reads from the run of KEY_BLOCK_ALIGN keys that holds its first query's
  first key (``window_keys`` in paged.py): keys before the window are read there, and masked;
- under PCP every rank holds the whole cache and attends its pieces of a row as rows that
  start at their first query's position (>= c), so the same holds;
- under DCP a rank stores a row's positions in its own order of local places, and reads from
  the run of KEY_BLOCK_ALIGN places holding ``local_len(p + 1 - w)``, or one place before it
  where its shard holds no key of the window (ctxpar/layers/dcp_metadata.py). Every rank holds
  at least ``(x // (D·I))·I`` of positions [0, x) (ctxpar/parallel/dcp_shard.py), so one bound
  serves every rank; a logical block is ``block_size`` places on each rank.

The whole-model rule, decided here alone: freeing applies only where every layer has the
window (Gemma's global layers, Qwen's below max_window_layers, an MLA model read every key)
and no draft model shares the block tables (its own layers, at its own positions).
"""

from __future__ import annotations

from dataclasses import dataclass

from ctxpar.layers.attention.backend import KEY_BLOCK_ALIGN
from ctxpar.model_args import ModelArgs


@dataclass(frozen=True)
class KVWindow:
    """The sliding window of ``keys`` every layer attends over, and how the cache is sharded."""

    keys: int  # w: a query at position p sees the keys at (p - w, p]
    dcp_size: int = 1  # D: ranks a sequence's KV is sharded over
    interleave: int = 1  # I: positions in a run on one DCP rank

    def __post_init__(self) -> None:
        if self.keys < 1 or self.dcp_size < 1 or self.interleave < 1:
            raise ValueError(f"a KV window needs keys, dcp_size and interleave >= 1, got {self}")

    def unread_blocks(self, num_computed: int, block_size: int) -> int:
        """How many of a sequence's leading blocks no later read can touch, once its first
        ``num_computed`` positions are in the cache. block_size: positions per logical block
        (block_size / D places on each DCP rank)."""
        first_key = max(0, num_computed + 1 - self.keys)  # the first key a query at c sees
        places = (
            first_key // (self.dcp_size * self.interleave) * self.interleave
        )  # every rank holds this many before it
        first_read = max(0, places - 1) // KEY_BLOCK_ALIGN * KEY_BLOCK_ALIGN  # the run a prompt chunk starts at
        return first_read // (block_size // self.dcp_size)


def freeing_window(args: ModelArgs, has_draft: bool) -> int | None:
    """The window (keys) whose out-of-reach blocks the block manager may free, or None: where
    some layer attends every key, or a draft model reads the same block tables."""
    if has_draft or len(args.sliding_layers) < args.num_hidden_layers:
        return None
    return args.sliding_window
