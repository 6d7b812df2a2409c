"""The data collectives of PCP ranks on one host, through shared pages.

gloo moves each collective through a socket and its own I/O thread, which
costs milliseconds a collective on a host whose cores all compute, and a
decode step has one per layer (docs/benchmarks.md, "Ranks on one host"). Here each rank copies its part
into its slot of a shared buffer, meets the others at a barrier (a counter
per rank, kernels/shm_barrier.cpp: microseconds when the ranks are in step),
and copies out what it needs.

Layout of the segment (host_shm.shared_segment)::

    [ counters: one int64 per rank, a cache line each | pids ]  HEADER bytes
    [ buffer 0: slot of rank 0 | ... | slot of rank P-1 ]        P x SLOT_BYTES
    [ buffer 1: the same ]

Collective number s uses buffer s % 2. A rank writes buffer b again at
collective s + 2, which it reaches only after every rank has arrived at
s + 1, that is after every rank has finished reading s: one barrier per
collective suffices. Data larger than a slot goes in several rounds.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ctxpar import kernels
from ctxpar.parallel.host_shm import shared_segment

SLOT_BYTES = 4 << 20
HEADER = 4096
LINE = 64  # bytes between two ranks' counters
PIDS_AT = 2048


class PeerLost(RuntimeError):
    """A rank's process died, or stayed silent past the timeout, during a collective."""


class ShmChannel:
    def __init__(self, store: dist.Store, rank: int, size: int, timeout_s: float, slot_bytes: int = SLOT_BYTES) -> None:
        """Map the shared segment (every rank of the group calls this at once)."""
        assert size * LINE <= PIDS_AT and PIDS_AT + 8 * size <= HEADER
        self.rank, self.size, self.timeout_s, self.slot_bytes = rank, size, timeout_s, slot_bytes
        self.segment = shared_segment(store, rank, size, "channel", HEADER + 2 * size * slot_bytes)
        self.counters = self.segment[: size * LINE].view(torch.int64)  # rank k's at [k * LINE / 8]
        self.pids = self.segment[PIDS_AT : PIDS_AT + 8 * size].view(torch.int64)  # 0: not yet known
        self.buffers = self.segment[HEADER:].view(2, size, slot_bytes)
        self.pids[rank] = os.getpid()
        self.seq = 0  # collectives completed: the same on every rank
        self._arrive()  # every pid is written once all have arrived

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(n, ...) on every rank -> (P*n, ...): rank k's rows at [k*n, (k+1)*n)."""
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        self._gather(_bytes(x), _bytes(out).view(self.size, -1))
        return out

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """(m, ...) on every rank -> (P, m, ...) on rank 0, None elsewhere."""
        x = x.contiguous()
        out = x.new_empty((self.size, *x.shape)) if self.rank == 0 else None
        self._gather(_bytes(x), None if out is None else _bytes(out).view(self.size, -1))
        return out

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """(P, m, ...) on every rank -> (P, m, ...): row k of the result is rank k's row ``self.rank``."""
        x = x.contiguous()
        out = torch.empty_like(x)
        src, dst = _bytes(x).view(self.size, -1), _bytes(out).view(self.size, -1)  # (P, B) each
        chunk = self.slot_bytes // self.size
        for off in range(0, src.shape[1], chunk):
            c = min(chunk, src.shape[1] - off)
            self._slot()[: self.size * c].view(self.size, c).copy_(src[:, off : off + c])
            slots = self._arrive()  # (P, slot_bytes)
            dst[:, off : off + c].copy_(slots[:, : self.size * c].view(self.size, self.size, c)[:, self.rank])
        return out

    def broadcast_(self, x: torch.Tensor, timeout_s: float | None = None) -> None:
        """Rank 0's x (contiguous) into every other rank's x, in place.
        timeout_s: how long to wait for the first round (default: the channel's)."""
        data = _bytes(x)
        for off in range(0, data.numel(), self.slot_bytes):
            c = min(self.slot_bytes, data.numel() - off)
            if self.rank == 0:
                self._slot()[:c].copy_(data[off : off + c])
            slots = self._arrive(timeout_s if off == 0 else None)
            if self.rank != 0:
                data[off : off + c].copy_(slots[0, :c])

    def _gather(self, src: torch.Tensor, dst: torch.Tensor | None) -> None:
        """src (B,) uint8 from every rank into dst (P, B) (None: this rank only sends)."""
        for off in range(0, src.numel(), self.slot_bytes):
            c = min(self.slot_bytes, src.numel() - off)
            self._slot()[:c].copy_(src[off : off + c])
            slots = self._arrive()
            if dst is not None:
                dst[:, off : off + c].copy_(slots[:, :c])

    def _slot(self) -> torch.Tensor:  # (slot_bytes,) uint8: this rank's slot for the next collective
        return self.buffers[self.seq % 2, self.rank]

    def _arrive(self, timeout_s: float | None = None) -> torch.Tensor:
        """Wait for every rank at collective ``seq`` (at most timeout_s, default the
        channel's; inf: as long as the others live); returns its buffer (P, slot_bytes)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        buffer = self.buffers[self.seq % 2]
        self.seq += 1
        lib = kernels._library()
        assert lib is not None  # a channel is made only where on_one_host found the kernels built
        code = lib.shm_barrier(
            self.counters.data_ptr(), LINE // 8, self.rank, self.size, self.seq, self.pids.data_ptr(), timeout_s
        )
        if code > 0:
            raise PeerLost(f"PCP rank {code - 1} is gone (its process ended during a collective)")
        if code < 0:
            raise PeerLost(f"a PCP rank was silent for {timeout_s:.0f} s during a collective")
        return buffer


def _bytes(t: torch.Tensor) -> torch.Tensor:  # a contiguous tensor's storage as (nbytes,) uint8
    return t.view(-1).view(torch.uint8)
