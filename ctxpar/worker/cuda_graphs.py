"""What CUDA graphs of decode steps need that does not need a GPU: the sizes they
are captured for, padding a step to them, the memory they may take, and the
static buffers a step's inputs are copied into before a replay.

A graph replays fixed kernels on fixed addresses, so a step must fit a captured
shape: its rows padded up to the next captured batch size (``capture_sizes``,
as vLLM's: 1, 2, 4, then every 8), and its longest context up to the next key
bucket (``key_buckets``: powers of two). The paged attention's metadata, each
row's block table and context length, lives in ``StaticBuffers``; the slot
table the attention gathers keys through is computed from them inside the
graph, so one graph serves every context length up to its bucket and every
block layout.

Padding rows copy row 0 (its token, position, blocks and slot): they compute
row 0's values and write row 0's KV entry to row 0's slot again, the same
bytes, so neither the cache nor the real rows see them; their outputs are
dropped. ``graph_runner.py`` captures and replays on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ctxpar.models.base import DecodeShape

MAX_CAPTURE_BATCH = 256  # beyond this, a decode step is long enough to run eagerly
MIN_KEYS = 256  # the smallest key bucket


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes graphs are captured for, up to ``max_batch`` (at most MAX_CAPTURE_BATCH):
    1, 2, 4, then multiples of 8, and ``max_batch`` itself."""
    top = min(max_batch, MAX_CAPTURE_BATCH)
    if top < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = {s for s in (1, 2, 4) if s <= top} | set(range(8, top + 1, 8)) | {top}
    return sorted(sizes)


def key_buckets(max_model_len: int, block_size: int) -> list[int]:
    """Key counts graphs are captured for: powers of two from MIN_KEYS, the last one
    ``max_model_len`` rounded up to whole blocks (no row has more keys)."""
    top = -(-max_model_len // block_size) * block_size
    buckets = []
    keys = MIN_KEYS
    while keys < top:
        buckets.append(keys)
        keys *= 2
    return [*buckets, top]


def bucket(value: int, sizes: list[int]) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``value``; None if none does."""
    for size in sizes:
        if size >= value:
            return size
    return None


@dataclass(frozen=True)
class CapturePlan:
    """The graphs to capture: every (batch size, key bucket) pair; ``shape``: the model's
    decode step (its ``fast_decode``), which bounds their memory."""

    sizes: list[int]
    buckets: list[int]
    shape: DecodeShape

    @property
    def graphs(self) -> list[tuple[int, int]]:
        """Largest first: captured so, later graphs reuse the first's pool."""
        return sorted(((b, k) for b in self.sizes for k in self.buckets), reverse=True)

    @property
    def memory_bound(self) -> int:
        """Bytes the graphs' shared pool may hold: the largest graph's temporaries (the
        graphs replay one at a time, so the pool's blocks are reused)."""
        return self.shape.graph_bytes(self.sizes[-1], self.buckets[-1])

    def fit(self, rows: int, max_keys: int) -> tuple[int, int] | None:
        """The graph a step of ``rows`` decodes whose longest row attends ``max_keys``
        keys replays in; None if no captured graph holds it (the step runs eagerly)."""
        b, k = bucket(rows, self.sizes), bucket(max_keys, self.buckets)
        return None if b is None or k is None else (b, k)


class StaticBuffers:
    """A decode step's inputs at fixed addresses, sized for the largest graph.

    ids, positions, write_slots: (B,) int64; seq_lens: (B,) int64, keys each row
    attends (its context and its new token); block_tables: (B, max_blocks) int64."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device) -> None:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        self.ids, self.positions, self.write_slots = (zeros(max_batch) for _ in range(3))
        self.seq_lens = zeros(max_batch) + 1  # a row attends at least its own key, before any fill too
        self.block_tables = zeros(max_batch, max_blocks)

    def fill(
        self, ids: np.ndarray, computed: np.ndarray, block_tables: list[np.ndarray], block_size: int, batch: int
    ) -> None:
        """Copy a step of decodes in, padded to ``batch`` rows with copies of row 0: row r's
        token ``ids[r]`` at position ``computed[r]`` (its tokens already cached), its KV
        blocks ``block_tables[r]``."""
        rows = len(ids)
        if not 0 < rows <= batch <= self.ids.shape[0]:
            raise ValueError(f"{rows} rows do not fit a graph of {batch} (buffers for {self.ids.shape[0]})")
        pad = np.concatenate([np.arange(rows), np.zeros(batch - rows, dtype=np.int64)])
        ids, computed = np.asarray(ids, dtype=np.int64)[pad], np.asarray(computed, dtype=np.int64)[pad]
        tables = np.zeros((batch, self.block_tables.shape[1]), dtype=np.int64)
        if int(computed.max()) >= tables.shape[1] * block_size:
            raise ValueError(f"a row at position {int(computed.max())} is beyond the buffers' blocks")
        for i, r in enumerate(pad):  # blocks past the buffers' hold no position a graph reads
            table = block_tables[r][: tables.shape[1]]
            tables[i, : len(table)] = table
        slots = tables[np.arange(batch), computed // block_size] * block_size + computed % block_size
        for buffer, values in (
            (self.ids, ids),
            (self.positions, computed),
            (self.seq_lens, computed + 1),
            (self.write_slots, slots),
        ):
            buffer[:batch].copy_(torch.from_numpy(values), non_blocking=True)
        self.block_tables[:batch].copy_(torch.from_numpy(tables), non_blocking=True)


def slot_table(block_tables: torch.Tensor, seq_lens: torch.Tensor, keys: int, block_size: int) -> torch.Tensor:
    """(B, keys) cache slot of each row's positions 0..keys-1, a row's positions past its
    length repeating its last slot (a written entry, so padded keys read finite values,
    which the attention's mask then drops): static shapes, so a graph can compute it."""
    cols = torch.arange(keys, device=block_tables.device)
    pos = torch.minimum(cols[None, :], seq_lens[:, None] - 1)  # (B, keys)
    return block_tables.gather(1, pos // block_size) * block_size + pos % block_size
