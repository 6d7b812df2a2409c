"""Paged KV-cache bookkeeping: which fixed-size blocks each request owns, and
which full blocks hold a known prefix (automatic prefix caching).

The KV cache is ``num_blocks`` blocks of ``block_size`` token slots. A request
owns a block table (a list of block ids); position p of the request lives in
slot ``table[p // block_size] * block_size + p % block_size``. The model runner
computes the slots from the tables in the StepPlan, so this class deals in
block ids only, and knows nothing of tensors, ranks or PCP.

Prefix caching. A full block is identified by a hash chain: the hash of block i
covers (hash of block i-1, the block's token ids), so equal hashes mean equal
whole prefixes. A request's ``cache_salt`` enters its first block's hash, so
chains of different salts (or salted and unsalted) never meet: a tenant's
requests share blocks only with each other, and nobody can learn from hit
timings what another tenant's prompts began with. Once an owner's full block
is computed, the caller registers its hash (``cache_blocks``); a later owner
whose prompt starts with the same blocks takes them (``cached_prefix`` then
``allocate(..., cached=...)``) instead of computing them again. Blocks are reference-counted, so running
owners share them. A block whose count drops to zero keeps its content and
hash in the free pool; the pool hands out a block that holds no hash first
(the most recently freed: the memory last written, still warm, so a pool without
caching keeps reusing the few blocks its requests need instead of walking the
whole cache, each first touch a page fault), then its least recently freed
block, and only then forgets ("evicts") that block's hash. Only full blocks
whose KV is written are ever registered, so a shared block is never written.

Sliding windows. Given a ``KVWindow`` (kv_window.py: every layer of the model
windowed), ``free_unread`` gives back a sequence's leading blocks that no later
read can touch. Their table entries then name the null block, the last of the
cache, kept out of the pool: a table keeps one entry per block of positions, so
every later position keeps its slot, and a null entry is never written (a step
writes only positions >= its computed tokens) nor read. A block freed so keeps
its content and hash in the pool like any other unreferenced block, and is a
prefix hit only until it is evicted, when its hash goes with it. A table that
starts from a prefix hit takes only the cached blocks its first step reads, and
only those must still be cached: a block's hash names its whole prefix, so the
KV it holds is right whichever blocks before it were evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from ctxpar.engine.kv_window import KVWindow

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: str | None = None) -> BlockHash:
    """The chain hash of one full block. SHA-256, not Python's ``hash``: a
    collision would hand one prompt another prompt's KV (wrong tokens), and
    64-bit builtin hashes of integer tuples can be collided on purpose. salt:
    the request's ``cache_salt``, given for a chain's first block (parent None)."""
    h = hashlib.sha256(parent or b"")
    if salt is not None:
        # 43 bytes before the tokens: no unsalted block's input (0 or 32 bytes before its
        # tokens) has this length, so no salted chain can meet an unsalted one.
        h.update(b"cache_salt\0" + hashlib.sha256(salt.encode("utf-8", "surrogatepass")).digest())
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash], tokens: Sequence[int], block_size: int, salt: str | None = None
) -> None:
    """Extend, in place, the chain ``hashes`` of a sequence's first full blocks
    with every full block of ``tokens``: the sequence's tokens from position
    ``len(hashes) * block_size`` on. Kept per request, so each block is hashed
    once. salt: the request's ``cache_salt`` (None: none), in its first block's hash."""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        hashes.append(hash_block(hashes[-1], block) if hashes else hash_block(None, block, salt))


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups in tokens, as vLLM counts them: every admission
    queries its known tokens; hits are the tokens it did not compute."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    """Allocates KV blocks to owners (request ids), shares cached full blocks
    between them, and takes blocks back."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, window: KVWindow | None = None
    ) -> None:
        """num_blocks: the cache's blocks; with a ``window``, the last is the null block and
        ``num_blocks`` counts the others."""
        if num_blocks < 1 + (window is not None) or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1 (2 blocks with a window), got {num_blocks}, {block_size}"
            )
        if window is not None and block_size % window.dcp_size:
            raise ValueError(f"block_size {block_size} is not a whole number of blocks on each DCP rank")
        num_blocks -= window is not None
        self.num_blocks = num_blocks
        self.window = window
        self.null_block = num_blocks  # where a table's freed entries point: never in the pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks  # set while the block is in _cached
        self._cached: dict[BlockHash, int] = {}
        # Blocks nobody references, oldest-freed first. New blocks come from the
        # front (evicting a cached one loses the least recently used prefix);
        # freed blocks go to the back, which also spreads writes when nothing is
        # cached and makes stale-slot bugs show up in tests instead of being masked.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._tables: dict[Hashable, list[int]] = {}
        self._num_registered: dict[Hashable, int] = {}  # leading blocks of a table already offered to the cache
        self._num_unread: dict[Hashable, int] = {}  # leading entries of a table freed by the window (null)
        self.num_evictions = 0  # cached blocks reused for other content, for tests and metrics

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def block_table(self, owner: Hashable) -> list[int]:
        """The owner's block ids in position order (empty if it owns none)."""
        return self._tables.get(owner, [])

    # -- prefix lookups -------------------------------------------------------

    def cached_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks holding the longest cached prefix of a hash chain (none
        when caching is off). Changes nothing: pass the result to ``allocate``.
        With a window, only the blocks a table starting there reads must be
        cached (a block's hash names its whole prefix, so its KV stands alone);
        the entries before them are the null block."""
        if not self.enable_caching:
            return []
        found = [self._cached.get(h) for h in hashes]
        longest = start = 0  # start: the first block of the run of cached ones up to k
        for k, block in enumerate(found, 1):
            if block is None:
                start = k
            elif start <= self._unread_prefix(k):
                longest = k
        unread = self._unread_prefix(longest)
        return [self.null_block] * unread + [b for b in found[unread:longest] if b is not None]

    # -- allocation -------------------------------------------------------------

    def num_new_blocks(self, owner: Hashable, num_tokens: int, cached: Sequence[int] = ()) -> int:
        """Free-pool blocks the owner needs so that its table covers
        ``num_tokens``, when a new owner starts with the ``cached`` blocks (a
        cached block nobody references is in the pool, so it counts too; one
        the window has left is not taken)."""
        have = len(self.block_table(owner)) + len(cached)
        taken = cached[self._unread_prefix(len(cached)) :]
        return max(0, self.blocks_for(num_tokens) - have) + sum(self._ref[b] == 0 for b in taken)

    def _unread_prefix(self, num_cached: int) -> int:
        """How many of a new table's first ``num_cached`` blocks, all cached, its first step
        (from the tokens they hold on) never reads: with a window, they start null; none without."""
        if self.window is None:
            return 0
        return self.window.unread_blocks(num_cached * self.block_size, self.block_size)

    def can_allocate(self, owner: Hashable, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Whether the owner's table can grow to cover ``num_tokens`` tokens now."""
        return self.num_new_blocks(owner, num_tokens, cached) <= len(self._free)

    def max_coverable_tokens(self, owner: Hashable) -> int:
        """Most tokens the owner's table could cover using every free block."""
        return (len(self.block_table(owner)) + len(self._free)) * self.block_size

    def allocate(self, owner: Hashable, num_tokens: int, cached: Sequence[int] = ()) -> list[int]:
        """Grow the owner's table (creating it if needed, starting with the
        ``cached`` blocks from ``cached_prefix``) to cover ``num_tokens`` tokens
        and return it. Raises, changing nothing, if the pool is too small;
        check ``can_allocate`` first. A table never shrinks here: see ``free``."""
        if cached and owner in self._tables:
            raise ValueError(f"cached blocks can only start a new table; {owner!r} already has one")
        need = self.num_new_blocks(owner, num_tokens, cached)
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self._free)} free")
        table = self._tables.setdefault(owner, [])
        unread = self._unread_prefix(len(cached))
        table += [self.null_block] * unread
        for block in cached[unread:]:
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1
            table.append(block)
        self._num_registered.setdefault(owner, len(cached))
        self._num_unread.setdefault(owner, unread)
        for _ in range(self.blocks_for(num_tokens) - len(table)):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref[block] = 1
            table.append(block)
        return table

    def cache_blocks(self, owner: Hashable, hashes: Sequence[BlockHash], num_blocks: int) -> None:
        """Register the owner's first ``num_blocks`` blocks, whose chain is
        ``hashes[:num_blocks]``. Call it only for full blocks whose KV is
        written: a registered block is handed to other owners as is. Blocks
        registered before are skipped; a block whose hash another block holds
        already stays private (the same prefix computed twice at once)."""
        if not self.enable_caching or owner not in self._tables or num_blocks <= self._num_registered[owner]:
            return
        table = self._tables[owner]
        if not num_blocks <= min(len(hashes), len(table)):
            raise ValueError(f"cannot register {num_blocks} blocks: {len(hashes)} hashes, {len(table)} blocks")
        # A block the window freed before it was offered is not in the table any more (the
        # scheduler offers blocks first: this keeps the index from naming the null block).
        for i in range(max(self._num_registered[owner], self._num_unread[owner]), num_blocks):
            if hashes[i] not in self._cached:
                self._cached[hashes[i]] = table[i]
                self._hash[table[i]] = hashes[i]
        self._num_registered[owner] = num_blocks

    def free(self, owner: Hashable) -> int:
        """Drop the owner's references; returns how many blocks it held still. A block
        nobody references joins the pool with its content and hash kept (``_unreference``).
        The table goes in reverse, so a sequence's last blocks are evicted before its
        first ones, which every longer prefix needs, and its first hashless blocks are
        reused first."""
        table = self._tables.pop(owner, [])
        self._num_registered.pop(owner, None)
        del table[: self._num_unread.pop(owner, 0)]  # given back already
        for block in reversed(table):
            self._unreference(block)
        return len(table)

    def truncate(self, owner: Hashable, num_tokens: int) -> int:
        """Shrink the owner's table to the blocks that hold its first ``num_tokens``
        tokens (speculative tokens rejected: their KV is discarded); returns how many
        blocks it gave back. Those blocks were never registered (only written full
        blocks are) nor shared, and go to the front of the free pool, so the next
        allocation reuses them before it evicts any cached block."""
        table = self._tables.get(owner, [])
        keep = self.blocks_for(num_tokens)
        if keep < max(self._num_registered.get(owner, 0), self._num_unread.get(owner, 0)):
            raise ValueError(
                f"cannot truncate {owner!r} to {num_tokens} tokens: its registered or freed blocks go further"
            )
        dropped = table[keep:]
        del table[keep:]
        for block in reversed(dropped):
            assert self._ref[block] == 1 and self._hash[block] is None  # past the computed tokens: private
            self._unreference(block)
        return len(dropped)

    def _unreference(self, block: int) -> None:
        """One reference fewer; a block nobody references joins the pool: at its end with
        a hash (least recently freed first), at its front without one (reused first)."""
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._free[block] = None
            if self._hash[block] is None:
                self._free.move_to_end(block, last=False)

    def free_unread(self, owner: Hashable, num_computed: int) -> int:
        """With a window, give back the owner's leading blocks that no later read can touch once
        its first ``num_computed`` tokens are in the cache (``KVWindow.unread_blocks``); returns
        how many. Their entries name the null block from then on; a block other owners share
        stays theirs, and one registered stays a prefix hit until evicted (see the module)."""
        if self.window is None or owner not in self._tables:
            return 0
        table = self._tables[owner]
        done = self._num_unread[owner]
        end = min(self.window.unread_blocks(num_computed, self.block_size), len(table))
        for i in range(done, end):
            block, table[i] = table[i], self.null_block
            self._unreference(block)
        self._num_unread[owner] = max(done, end)
        return max(0, end - done)

    def num_live_blocks(self, owner: Hashable) -> int:
        """Blocks the owner holds (its table's entries but those the window freed)."""
        return len(self.block_table(owner)) - self._num_unread.get(owner, 0)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block's hash (as vLLM's: only when no block is
        referenced, else nothing changes and False is returned)."""
        if any(self._ref):
            return False
        self._cached.clear()
        self._hash = [None] * self.num_blocks
        return True

    def forget_unreferenced(self) -> int:
        """Forget the hashes of the cached blocks nobody references (their KV can no longer
        be trusted: a lost rank held part of it); returns how many. Referenced blocks keep
        theirs: their KV is restored with their requests'."""
        stale = [(b, h) for b in self._free if (h := self._hash[b]) is not None]
        for block, h in stale:
            del self._cached[h]
            self._hash[block] = None
        return len(stale)

    def _evict(self, block: int) -> None:
        h = self._hash[block]
        if h is not None:
            del self._cached[h]
            self._hash[block] = None
            self.num_evictions += 1

    def owners(self) -> list[Hashable]:
        return list(self._tables)

    def check_integrity(self) -> None:
        """Assert the accounting: every block id is in range; a block's
        reference count equals the number of tables holding it (a table holds
        a block at most once); the free pool is exactly the unreferenced
        blocks; the hash index and the per-block hashes agree."""
        refs = [0] * self.num_blocks
        for owner, table in self._tables.items():
            unread = self._num_unread[owner]
            if table[:unread] != [self.null_block] * unread or self.null_block in table[unread:]:
                raise AssertionError(f"table of {owner!r}: the null block must be its first {unread} entries")
            live = table[unread:]
            if len(set(live)) != len(live):
                raise AssertionError(f"table of {owner!r} holds a block twice: {table}")
            for block in live:
                if not 0 <= block < self.num_blocks:
                    raise AssertionError(f"block id {block} out of range in the table of {owner!r}")
                refs[block] += 1
            if not 0 <= self._num_registered[owner] <= len(table):
                raise AssertionError(f"{owner!r}: {self._num_registered[owner]} registered of {len(table)} blocks")
        if refs != self._ref:
            raise AssertionError("block reference counts do not match the tables")
        unreferenced = {b for b in range(self.num_blocks) if refs[b] == 0}
        if set(self._free) != unreferenced:
            raise AssertionError(f"free pool holds {len(self._free)} blocks; {len(unreferenced)} are unreferenced")
        if set(self._num_registered) != set(self._tables) or set(self._num_unread) != set(self._tables):
            raise AssertionError("registration or window counts and tables name different owners")
        for h, block in self._cached.items():
            if self._hash[block] != h:
                raise AssertionError(f"hash index points at block {block}, which holds another hash")
        if sum(h is not None for h in self._hash) != len(self._cached):
            raise AssertionError("a block keeps a hash the index has forgotten")
