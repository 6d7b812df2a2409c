"""The start-up handshake: how PCP ranks come together, and how a rank that
fails or dies on the way is named within a poll interval.

Keys on the rendezvous store (under a prefix of their own per executor):
  started/r  spawned rank r reached its entry point (before loading its model)
  ready/r    rank r has loaded its model and waits for the verdict
  error/r    rank r failed while starting: one line saying why
  verdict    rank 0's decision: "go" once every rank is ready, else why it gave up

The keys lie under the launch's nonce, so a value of another launch is at
another key, and every value is tagged: a presence key (``started/r``,
``ready/r``) counts only once its tag checks (a forged one is not counted; the
rank that should write it overwrites it), a forged ``error/r`` or ``verdict``
is refused when read (auth.Unauthenticated).

The process group is formed only after "go", when every rank is present, so
no rank sits in a blocking collective waiting for a peer that is still
loading its model, or dead. Waiting is done by polling the store (and, on
rank 0, the spawned processes) every POLL_S: a dead rank is noticed at once
instead of at the end of the start-up timeout.
"""

from __future__ import annotations

import signal
import time
from multiprocessing.process import BaseProcess

import torch.distributed as dist

from ctxpar.errors import RankFailure
from ctxpar.parallel.comm import STARTUP_TIMEOUT_S
from ctxpar.parallel.signed_store import signed_present

POLL_S = 0.1
GO = "go"

MAIN_GUARD_HINT = (
    "before reaching ctxpar's worker code, i.e. while importing the main module: a script that creates "
    'LLM(pcp_size > 1) must do so under `if __name__ == "__main__":`, because every spawned rank imports '
    "the main module again (otherwise see the rank's output above)"
)


def exit_reason(exitcode: int | None) -> str:
    """'exited with code 1' or 'was killed by SIGKILL' for a finished process."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def lead(store: dist.Store, size: int, procs: dict[int, BaseProcess], deadline: float) -> None:
    """Rank 0: wait until ranks 1..size-1 are ready, then tell them to go.

    procs: the spawned ranks' processes (empty under torchrun, where only the
    store says how the other ranks are doing). Raises RankFailure naming the
    first rank that failed or died, or the ranks still missing at the deadline.
    """
    await_ready(store, list(range(1, size)), procs, deadline)
    store.set("verdict", GO)


def await_ready(store: dist.Store, ranks: list[int], procs: dict[int, BaseProcess], deadline: float) -> None:
    """Rank 0: wait until ``ranks`` are ready (see lead)."""
    ready = [f"ready/{r}" for r in ranks]
    while not signed_present(store, ready):
        for r in ranks:
            _raise_if_failed(store, r, procs.get(r))
        if time.monotonic() > deadline:
            missing = [str(r) for r in ranks if not signed_present(store, [f"ready/{r}"])]
            raise RankFailure(
                f"PCP rank(s) {', '.join(missing)} not ready after {STARTUP_TIMEOUT_S} s "
                "(still loading the model, or unable to reach rank 0)"
            )
        time.sleep(POLL_S)


def _raise_if_failed(store: dist.Store, rank: int, proc: BaseProcess | None) -> None:
    dead = proc is not None and not proc.is_alive()
    if store.check([f"error/{rank}"]):
        how = f" and {exit_reason(proc.exitcode)}" if dead and proc is not None else ""
        raise RankFailure(f"PCP rank {rank} failed while starting{how}: {store.get(f'error/{rank}').decode()}")
    if dead:
        assert proc is not None  # only a process can be dead
        if signed_present(store, [f"started/{rank}"]):
            where = ", while loading the model"
        elif proc.exitcode == 1:  # a Python error before the worker's code ran: importing __main__
            where = ", " + MAIN_GUARD_HINT
        else:
            where = ""
        raise RankFailure(f"PCP rank {rank} {exit_reason(proc.exitcode)} during start-up{where}")


def abandon(store: dist.Store | None, why: str) -> None:
    """Rank 0 gave up: tell the ranks waiting for the verdict (best effort)."""
    try:
        if store is not None:
            store.set("verdict", why)
    except Exception:
        pass  # the store is gone too: the ranks' next poll fails on their own


def follow(store: dist.Store, rank: int, deadline: float) -> None:
    """A worker: announce that it is ready and wait for rank 0's verdict."""
    store.set(f"ready/{rank}", "")
    while not store.check(["verdict"]):
        if time.monotonic() > deadline:
            raise RankFailure(f"rank 0 did not start the PCP ranks within {STARTUP_TIMEOUT_S} s")
        time.sleep(POLL_S)  # a dead rank 0 (spawned case) takes its store along: check() raises
    verdict = store.get("verdict").decode()
    if verdict != GO:
        raise RankFailure(f"rank 0 gave up starting the PCP ranks: {verdict}")


def report_failure(store: dist.Store | None, rank: int, e: BaseException) -> None:
    """A worker that failed while starting tells rank 0 why (best effort)."""
    try:
        if store is not None:
            store.set(f"error/{rank}", first_line(e))
    except Exception:
        pass
