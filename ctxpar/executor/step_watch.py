"""Rank 0's watch over a step's torchrun ranks on other hosts.

A step's collectives fail at once when a rank's process dies, because its
kernel closes its sockets. A host that goes away without closing them (power
lost, its link cut) leaves rank 0 waiting for the collective timeout
(comm.DATA_TIMEOUT_S, 30 s by default). The ranks' heartbeats (regroup.py)
tell sooner: while rank 0 runs a step, a thread of its own reads them every
HEARTBEAT_S, and when one has stood still for HEARTBEAT_LOST_S it cuts rank
0's links of the group (parallel/group_links.py), so that the waiting collective
fails now and the step's error names the silent rank.

    main thread   | plan | layer .. all-gather (waits on rank 1) ......X fails
    watch thread  |  read beats .. beat/1 still .. still .. lost: cut links

Only for gloo groups across hosts: on one host the shared pages see a dead
rank's pid, and NCCL's connections are not sockets of this process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.distributed as dist

from ctxpar.executor.regroup import HEARTBEAT_S, Heartbeats


class StepWatch:
    """One daemon thread, reading heartbeats on a store connection of its own while
    ``watching`` is entered, idle otherwise; ``close`` ends it."""

    def __init__(self, connect: Callable[[], dist.Store]) -> None:
        """connect: opens the thread's store connection (on the thread, when it starts)."""
        self._connect = connect
        self._active = threading.Event()
        self._closed = threading.Event()
        self._ranks: list[int] = []  # torchrun rank numbers of the step's other ranks
        self._cut: Callable[[], object] = lambda: None
        self._lost: int | None = None  # the torchrun rank found silent, until take_lost
        self._thread = threading.Thread(target=self._run, name="ctxpar-step-watch", daemon=True)
        self._thread.start()

    @contextmanager
    def watching(self, ranks: list[int], cut: Callable[[], object]) -> Iterator[None]:
        """Watch the heartbeats of ``ranks`` (torchrun's numbers) for the block's length;
        ``cut`` (called on the watch's thread) makes the block's collectives fail."""
        self._ranks, self._cut, self._lost = ranks, cut, None
        self._active.set()
        try:
            yield
        finally:
            self._active.clear()

    def take_lost(self) -> int | None:
        """The torchrun rank whose silence cut the last watched block's links (None if none),
        once: a later failure, watched or not, is not blamed on it."""
        lost, self._lost = self._lost, None
        return lost

    def close(self) -> None:
        self._closed.set()
        self._active.set()  # wakes the thread to see it

    def _run(self) -> None:
        try:
            beats = Heartbeats(self._connect())
            while not self._closed.is_set():
                self._active.wait()
                while self._active.is_set() and not self._closed.is_set():
                    silent = [r for r in self._ranks if beats.stopped(r)]
                    if silent:
                        self._lost = silent[0]
                        self._active.clear()
                        self._cut()
                        break
                    self._closed.wait(HEARTBEAT_S)
        except Exception:
            return  # the store is gone (rank 0's torchrun with it): the collective timeout remains
