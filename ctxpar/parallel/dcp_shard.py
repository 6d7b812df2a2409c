"""DCP shard arithmetic: which rank stores which token's KV, and where.

With D ranks and interleave I, the token at position t lives only on rank
``(t // I) % D``. Positions go round-robin in runs of I tokens::

    D = 2, I = 2    position  0 1 2 3 4 5 6 7 8 9
                    rank      0 0 1 1 0 0 1 1 0 0

On its rank the token is the ``local_position``-th one of the sequence's
local tokens, ``(t // (D·I))·I + t % I``. A logical block of the block
manager covers ``block_size · D`` positions and gives each rank exactly
``block_size`` local tokens (I divides block_size), which that rank stores in
its own physical block of the same id. So local token j of a sequence sits in
slot ``table[j // block_size] · block_size + j % block_size`` on its rank
(``ctxpar.layers.step_description.slots_of(table, j, block_size)``), and
a rank's shard of positions [0, L) is its local tokens [0, local_len(L)).

Pure numpy, vectorised; every function broadcasts over arrays of positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DCPShard:
    """One rank's view of the sharding: D ranks, interleave I, this rank k."""

    size: int  # D
    interleave: int  # I
    rank: int  # k

    def owner(self, pos: np.ndarray) -> np.ndarray:
        """Rank that stores each position."""
        return (pos // self.interleave) % self.size

    def local_position(self, pos: np.ndarray) -> np.ndarray:
        """Index of each position among its owner's tokens of the sequence."""
        return (pos // (self.size * self.interleave)) * self.interleave + pos % self.interleave

    def local_len(self, seq_len: np.ndarray | int) -> np.ndarray:
        """How many of positions [0, seq_len) this rank stores (0 for a short sequence
        on a late rank)."""
        DI, I = self.size * self.interleave, self.interleave
        rounds, rest = np.divmod(seq_len, DI)
        return rounds * I + np.clip(rest - self.rank * I, 0, I)
