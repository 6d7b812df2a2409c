"""The other ranks as rank 0 sees them: spawned here (their processes) or started
by torchrun (their heartbeats); started, watched, named when lost, stopped.

Spawned workers ignore SIGINT (a terminal's Ctrl-C reaches the whole process
group): their lifetime is rank 0's to decide, and rank 0 stops them when it
is interrupted.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterable
from multiprocessing.process import BaseProcess

import torch.distributed as dist
import torch.multiprocessing as mp

from ctxpar.executor import rank_worker, regroup, startup
from ctxpar.parallel.comm import data_timeout_s

EXIT_GRACE_S = 1.0  # after a failed collective, how long to wait for a dying worker's exit code
# How long to wait for the exit code of a worker seen ending (its main thread a zombie):
# the process is reaped only once its last thread has left and its memory is given back,
# which on a loaded host can take seconds; it never hangs, so waiting costs only that.
ENDING_GRACE_S = 15.0


class RankProcesses:
    """Ranks 1..size-1, seen from rank 0: their processes where spawned here, their
    heartbeats under torchrun (``heartbeats`` set, no processes)."""

    def __init__(self, size: int) -> None:
        self.procs: list[BaseProcess] = []  # rank r's process at index r - 1 (spawned ranks)
        self.torchrun_ranks = list(range(size))  # torchrun's number of each rank now (heartbeats)
        self.heartbeats: regroup.Heartbeats | None = None  # torchrun ranks' (rank 0 reads them)

    def spawn(self, ranks: Iterable[int], args_of: Callable[[int], tuple]) -> None:
        """Start rank_worker.worker_main(*args_of(r)) for each rank r (a lost rank's replaced)."""
        ctx = mp.get_context("spawn")
        # The children inherit this thread's signal mask: with SIGINT blocked
        # while they start, a Ctrl-C during their imports cannot make them
        # print a traceback; worker_main ignores SIGINT and unblocks it.
        # (Rank 0 still gets the Ctrl-C: its other threads take it.)
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            for r in ranks:
                p = ctx.Process(target=rank_worker.worker_main, args=args_of(r), daemon=True)
                p.start()
                if r <= len(self.procs):
                    self.procs[r - 1] = p  # a respawned rank
                else:
                    self.procs.append(p)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def is_dead(self, rank: int) -> bool:
        """Whether a spawned rank's process has ended, or a torchrun rank's heartbeat stopped."""
        if self.heartbeats is not None:
            return self.heartbeats.stopped(self.torchrun_ranks[rank])
        return not self.procs[rank - 1].is_alive()

    def dead(self) -> list[tuple[int, BaseProcess]]:
        """The spawned ranks whose process has ended, by rank."""
        return [(r, p) for r, p in enumerate(self.procs, start=1) if not p.is_alive()]

    def lost(self, size: int, heartbeats: bool) -> str:
        """Which ranks are known lost, and how ("" if none). heartbeats: read torchrun
        ranks' heartbeats too (store round trips: only when idle; in a step, a lost
        rank fails the step's collectives anyway)."""
        if heartbeats and self.heartbeats is not None:
            silent = [r for r in range(1, size) if self.is_dead(r)]
            return ", ".join(f"PCP rank {r}'s heartbeat stopped" for r in silent)
        if self.heartbeats is None:
            return ", ".join(f"PCP rank {r} {startup.exit_reason(p.exitcode)}" for r, p in self.dead())
        return ""

    def await_exits(self) -> None:
        """Give the workers a moment to be seen dead: a peer's closed socket (or the
        shared-memory barrier's look at /proc) can fail a collective before its process
        is reaped. A worker already ending gets the time it takes to end, so that it is
        named with its signal, never taken for a live or hung one."""
        deadline = time.monotonic() + EXIT_GRACE_S
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive() and p.pid is not None and _ending(p.pid):
                p.join(timeout=ENDING_GRACE_S)

    def why_failed(self, e: BaseException, store: dist.Store | None) -> str:
        """Why a collective failed: the ranks that died (read before stop()
        forgets them), else the error, which after the collective timeout means a hung rank."""
        self.await_exits()
        dead = [f"rank {r} {startup.exit_reason(p.exitcode)}{_refused(store, p)}" for r, p in self.dead()]
        if dead:
            return "; ".join(dead) + f" ({startup.first_line(e)})"
        return f"{startup.first_line(e)} (a rank died, or was silent for {data_timeout_s():g} s)"

    def kill(self, ranks: Iterable[int]) -> None:
        """End these spawned ranks' processes at once."""
        for r in ranks:
            self.procs[r - 1].kill()
            self.procs[r - 1].join(timeout=5)

    def keep(self, ranks: list[int]) -> None:
        """After a recovery: old rank ranks[i] is rank i now (rank 0 stays rank 0)."""
        self.procs = [self.procs[r - 1] for r in ranks[1:]] if self.heartbeats is None else []
        self.torchrun_ranks = [self.torchrun_ranks[r] for r in ranks]

    def stop(self, graceful: bool) -> None:
        """Wait for the spawned ranks to leave (after rank 0 told them to, if graceful);
        kill those still there. Idempotent."""
        for p in self.procs:
            p.join(timeout=5 if graceful else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs = []


def _ending(pid: int) -> bool:
    """Whether process ``pid``'s main thread has exited (state Z in /proc, as the
    shared-memory barrier reads it: kernels/shm_barrier.cpp) while its other threads
    still leave; False where /proc is not there to say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat.rsplit(b")", 1)[-1][1:2] in (b"Z", b"X")  # the state follows the name, in parentheses


def _refused(store: dist.Store | None, proc: BaseProcess) -> str:
    """ ", after refusing a forged message (...)" when the worker left for that."""
    why = rank_worker.refusal(store, proc.pid)
    return f", after refusing a forged message ({why})" if why else ""
