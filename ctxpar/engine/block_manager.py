"""Paged KV-cache bookkeeping: which fixed-size blocks each request owns.

The KV cache is ``num_blocks`` blocks of ``block_size`` token slots. A request
owns a block table (a list of block ids); position p of the request lives in
slot ``table[p // block_size] * block_size + p % block_size``. The model runner
computes the slots from the tables in the StepPlan, so this class deals in
block ids only, and knows nothing of tensors, ranks or PCP.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class BlockManager:
    """Allocates KV blocks to owners (request ids) and takes them back."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # FIFO reuse: a freed block goes to the back, which spreads writes and
        # makes stale-slot bugs show up in tests instead of being masked.
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[Hashable, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def block_table(self, owner: Hashable) -> list[int]:
        """The owner's block ids in position order (empty if it owns none)."""
        return self._tables.get(owner, [])

    def num_new_blocks(self, owner: Hashable, num_tokens: int) -> int:
        """Blocks the owner must add so that its table covers ``num_tokens``."""
        return max(0, self.blocks_for(num_tokens) - len(self.block_table(owner)))

    def can_allocate(self, owner: Hashable, num_tokens: int) -> bool:
        """Whether the owner's table can grow to cover ``num_tokens`` tokens now."""
        return self.num_new_blocks(owner, num_tokens) <= len(self._free)

    def max_coverable_tokens(self, owner: Hashable) -> int:
        """Most tokens the owner's table could cover using every free block."""
        return (len(self.block_table(owner)) + len(self._free)) * self.block_size

    def allocate(self, owner: Hashable, num_tokens: int) -> list[int]:
        """Grow the owner's table (creating it if needed) to cover ``num_tokens``
        tokens and return it. Raises if there are not enough free blocks; check
        ``can_allocate`` first. A table never shrinks here: see ``free``."""
        need = self.num_new_blocks(owner, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self._free)} free")
        table = self._tables.setdefault(owner, [])
        for _ in range(need):
            table.append(self._free.popleft())
        return table

    def free(self, owner: Hashable) -> int:
        """Return all of the owner's blocks to the free list; returns how many."""
        table = self._tables.pop(owner, [])
        self._free.extend(table)
        return len(table)

    def owners(self) -> list[Hashable]:
        return list(self._tables)

    def check_integrity(self) -> None:
        """Assert that the free list and the owned tables partition all blocks:
        every block id is in exactly one place, and every id is in range."""
        seen: list[int] = list(self._free)
        for table in self._tables.values():
            seen.extend(table)
        if len(seen) != self.num_blocks or sorted(seen) != list(range(self.num_blocks)):
            dup = len(seen) - len(set(seen))
            raise AssertionError(
                f"block accounting broken: {len(seen)} ids for {self.num_blocks} blocks, {dup} duplicates"
            )
