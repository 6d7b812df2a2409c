"""Memory on 2 MiB pages for what every decode step streams: the weights and the KV cache.

A decode step reads every weight and each row's whole context once. On 4 KiB
pages that is a TLB miss every 4 KiB (SmolLM2's Q4_1 weights and a 2K-token
int8 cache are ~30K pages, ten times what the TLB holds), each a page-table
walk whose entries have themselves been evicted by the step's other bytes.
Transparent huge pages cut the walks 512-fold: SmolLM2's Q4_1 decode steps take
0.94-0.97x the time (docs/benchmarks.md, "Decode steps as one compiled call").
Linux backs memory with them where it was advised ``MADV_HUGEPAGE`` before its
first touch (its default "madvise" mode), so a buffer here is a fresh private
anonymous mapping, advised, then filled.
Where the OS has no huge pages the advice is ignored and the pages are small.

A model's weights are written straight into such memory as they are read
(``HugeArena``), so that they are not laid out once and then copied there:
``on_huge_pages`` tells a weight that is there already from one to move.

A KV cache's pages are made ahead of the steps that write them (``FaultIn``):
a page's first touch clears it, which on a VM also makes the host back it, and
a prefill that wrote the first rows of fresh pages spent that in its step while
its other thread waited.
"""

from __future__ import annotations

import atexit
import ctypes
import math
import mmap
import os
import threading
import weakref

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # bytes: each of a HugeArena's tensors starts on a cache line
ARENA_CHUNK = 256 << 20  # bytes a HugeArena maps at a time (more for a larger tensor)
KV_AHEAD = 256 << 20  # bytes of a KV cache made beyond the steps' reach (SmolLM2's int8: ~23K tokens)
PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23  # Linux 5.14+: make pages writable now, their bytes left as they are

# The first bytes of huge_empty's mappings that are still alive: a tensor's storage
# starts there exactly when it is (a view of) one of them.
_LIVE: set[int] = set()


def huge_empty(nbytes: int) -> torch.Tensor:
    """A (nbytes,) uint8 tensor of zeros whose pages the OS is advised to make huge."""
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(nbytes, dtype=torch.uint8)
    # Private and anonymous: shared anonymous memory is shmem, whose huge pages are off by default.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE  # the first 2 MiB boundary: a huge page must be aligned
    region.madvise(mmap.MADV_HUGEPAGE, start, nbytes + HUGE_PAGE - start)
    _LIVE.add(raw.data_ptr())
    weakref.finalize(region, _LIVE.discard, raw.data_ptr())  # unmapped once its last tensor goes
    return raw[start : start + nbytes]


def on_huge_pages(t: torch.Tensor) -> bool:
    """Whether ``t`` lies in memory of ``huge_empty``'s advised huge (its mapping is still alive)."""
    return t.untyped_storage().data_ptr() in _LIVE


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on memory advised huge (see ``huge_empty``)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return huge_empty(nbytes).view(dtype).view(shape)


class HugeArena:
    """Tensors carved one after another out of memory advised huge, each on a cache
    line, for weights written where they will stay while the total is not yet known:
    it maps ``ARENA_CHUNK`` bytes at a time (or a larger tensor's own), and the pages
    of a mapping's unused end are never touched, so never made."""

    def __init__(self) -> None:
        self._chunk = torch.empty(0, dtype=torch.uint8)
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of zeros of ``shape`` and ``dtype`` in the arena, to be written."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        start = -(-self._used // ALIGN) * ALIGN
        if start + nbytes > self._chunk.numel():
            self._chunk, start = huge_empty(max(ARENA_CHUNK, nbytes)), 0
        self._used = start + nbytes
        return self._chunk[start : start + nbytes].view(dtype).view(shape)


class FaultIn:
    """Makes the pages of a cache ``t`` (of ``huge_empty``'s memory) ahead of the steps that
    write them, on a thread that runs only on otherwise idle CPUs (SCHED_IDLE).

    ``t`` is cut into ``stripes`` equal parts along its first dimension (a KV cache's
    layers), each ``rows`` rows along its second (its slots). The steps say how many rows
    of each part they have reached (``advance``: the block manager hands out blocks lowest
    id first, and a step writes a block's rows in every layer); the thread keeps ``ahead``
    bytes in all (at least a huge page of each part) beyond that made, one huge page of
    each part in turn, so memory is committed as the cache is used, never all at once. The advice
    (MADV_POPULATE_WRITE) leaves bytes as they are, so steps may write meanwhile. The
    thread holds ``t`` only while the kernel works on one page, so a closed engine's cache
    is freed at once; it ends then, or where the OS lacks the advice."""

    def __init__(self, t: torch.Tensor, stripes: int, ahead: int) -> None:
        self._ref = weakref.ref(t)
        self._start, self.part = t.data_ptr(), t.numel() * t.element_size() // stripes
        self._stripes, self.ahead = stripes, max(HUGE_PAGE, ahead // stripes)
        self.row_bytes = self.part // t.shape[1]
        self.wanted = 0  # bytes of each part the thread is to have made
        self.made = 0  # bytes of each part it has made
        self._stopped = False
        self._wake = threading.Condition()
        self.advance(0)
        self.thread = threading.Thread(target=self._run, name="kv-fault-in", daemon=True)
        self.thread.start()
        _RUNNING.add(self)

    @classmethod
    def of(cls, t: torch.Tensor, stripes: int, ahead: int) -> FaultIn | None:
        """A FaultIn of ``t``, or None where it is not ``huge_empty``'s memory (nothing to do)."""
        if not on_huge_pages(t) or t.shape[0] % stripes:
            return None
        return cls(t, stripes, ahead)

    def advance(self, rows: int) -> None:
        """The steps have reached ``rows`` rows of every part: keep ``ahead`` bytes beyond made."""
        want = min(self.part, rows * self.row_bytes + self.ahead)
        if want > self.wanted:
            with self._wake:
                self.wanted = want
                self._wake.notify()

    def stop(self) -> None:
        """End the thread and wait for it (at most one page's call)."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self.thread.join(timeout=10)

    def _run(self) -> None:
        madvise = ctypes.CDLL(None, use_errno=True).madvise  # a foreign call: the GIL is released
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread alone
        except (AttributeError, OSError):
            return  # at normal priority it would take CPU from the steps: they make the pages as before
        while True:
            with self._wake:
                while self.made >= self.wanted and not self._stopped:  # wakes now and then: is the cache gone?
                    if not self._wake.wait(timeout=1.0) and self._ref() is None:
                        return
                if self._stopped:
                    return
                want = self.wanted
            for offset in range(self.made, want, HUGE_PAGE):
                for stripe in range(self._stripes):
                    t = self._ref()  # alive for the call: its mapping cannot go while the kernel works on it
                    if t is None or self._stopped:
                        return
                    lo = self._start + stripe * self.part + offset
                    hi = self._start + stripe * self.part + min(offset + HUGE_PAGE, self.part)
                    lo, hi = lo - lo % PAGE, -(-hi // PAGE) * PAGE  # within the mapping: it starts on a huge page
                    failed = madvise(lo, hi - lo, MADV_POPULATE_WRITE) != 0
                    del t
                    if failed:
                        return  # an OS without the advice: the steps make the pages as before
            self.made = max(self.made, -(-want // HUGE_PAGE) * HUGE_PAGE)


# The threads of this process, stopped at exit: a daemon thread still in a foreign call when the
# interpreter finalizes is unwound by force there, which aborts the process (a rank that exits
# with a code would die of SIGABRT instead).
_RUNNING: weakref.WeakSet[FaultIn] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for fault_in in list(_RUNNING):
        fault_in.stop()
