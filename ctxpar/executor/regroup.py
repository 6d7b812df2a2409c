"""How the ranks meet again after one was lost.

Each recovery is a new *generation* of the group. Rank 0 decides who is in
it and announces it on the rendezvous store; the survivors, whose group broke
under them, check in, wait for that announcement and meet under the keys it
names, with the start-up handshake of startup.py (``started/r``, ``ready/r``,
``verdict``)::

    rank 0                        survivor k                  respawned rank j
    --------------------------    -------------------------   ----------------
    leaves the broken group       its collective fails:
                                  leaves the group,
    finds the lost ranks  <-----  checks in (alive/g/k)
    spawns rank j (gen g) ---------------------------------->  loads the model
    waits until j is ready  <-------------------------------- ready
    sets recover/g = members ---> sees recover/g
    lead(keys)                    follow(keys)                 follow(keys)
    PCPGroup(keys)                PCPGroup(keys)               PCPGroup(keys)
    keeps its runner              keeps its runner (KV cache)  a fresh runner

The members are the old ranks in their new order: ``[0, 1, 2]`` after a
respawn, ``[0, 2]`` when rank 1 could not come back (respawning failed, or
the ranks are torchrun's, which ctxpar cannot start): old rank 2 is then
rank 1 of a group of P - 1. Either way the survivors keep their KV caches;
the engine restores what respawned ranks lack (ctxpar/engine/rank_recovery.py).

Rank 0 tells a lost rank from a survivor by its process (spawned ranks) or,
under torchrun, by its heartbeat on the store: a rank whose heartbeat stops
without checking in is lost.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from ctxpar.errors import RankFailure
from ctxpar.executor.startup import POLL_S
from ctxpar.parallel.auth import Unauthenticated
from ctxpar.parallel.comm import STARTUP_TIMEOUT_S
from ctxpar.parallel.signed_store import read_signed, signed_present

HEARTBEAT_S = 0.5  # how often a torchrun rank says it lives
HEARTBEAT_LOST_S = 3.0  # a rank whose heartbeat stood still this long (and did not check in) is lost


@dataclass(frozen=True)
class Members:
    """Who is in a re-formed group: ``ranks[i]`` is the old rank of new rank i
    (rank 0 first), and the store prefix they meet under."""

    ranks: list[int]
    keys: str

    def new_rank(self, old: int) -> int | None:
        """This rank's number in the new group, or None when it was left out."""
        return self.ranks.index(old) if old in self.ranks else None


@dataclass(frozen=True)
class Regrouped:
    """What a recovery did: the ranks found lost (their numbers before it), those
    respawned (with empty caches, for the engine to restore), and the group's size now."""

    lost: list[int]
    respawned: list[int]
    size: int
    why_not_respawned: str | None  # when the lost ranks were left out instead


def generation_keys(generation: int) -> str:
    """The name of a generation, which keys its group's tags (PCPGroup) and, after a
    respawn, prefixes the keys it meets under."""
    return f"g{generation}/"


def generation_store(store: dist.Store, generation: int) -> dist.Store:
    """The keys the ranks of a generation meet under (generation 0: the executor's own)."""
    return store if generation == 0 else dist.PrefixStore(generation_keys(generation), store)


def check_in(store: dist.Store, generation: int, rank: int) -> None:
    """Survivor ``rank``: its group broke; it waits to join ``generation``."""
    store.set(f"alive/{generation}/{rank}", "")


def checked_in(store: dist.Store, generation: int, rank: int) -> bool:
    """Whether ``rank`` checked in, with a value whose tag checks (a forged one is not counted)."""
    return signed_present(store, [f"alive/{generation}/{rank}"])


def announce(store: dist.Store, generation: int, members: Members) -> None:
    """Rank 0: the survivors are to meet as ``members``."""
    store.set(f"recover/{generation}", json.dumps({"ranks": members.ranks, "keys": members.keys}))


def abandon(store: dist.Store | None, generation: int, why: str) -> None:
    """Rank 0 gives up recovering: the survivors waiting for ``generation`` exit (best effort)."""
    try:
        if store is not None:
            store.set(f"recover/{generation}", json.dumps({"gave_up": why}))
    except Exception:
        pass  # the store is gone: their next poll fails on its own


def await_recovery(store: dist.Store, generation: int, rank: int, failure: RankFailure) -> Members:
    """Survivor ``rank``, whose group broke with ``failure``: wait until rank 0 announces
    ``generation``. RankFailure when rank 0 is gone (its store with it), gives up or stays silent."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    key = f"recover/{generation}"
    try:
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise RankFailure(f"{failure}; rank 0 did not re-form the PCP group within {STARTUP_TIMEOUT_S} s")
            time.sleep(POLL_S)
        value = json.loads(store.get(key))
    except (RankFailure, Unauthenticated):
        raise
    except Exception as e:  # the store's connection: rank 0 is gone
        raise RankFailure(f"{failure}, and rank 0's rendezvous store is gone ({type(e).__name__})") from e
    if "gave_up" in value:
        raise RankFailure(f"{failure}; rank 0 gave up recovering: {value['gave_up']}")
    return Members(value["ranks"], value["keys"])


class Heartbeats:
    """Rank 0's view of the torchrun ranks' heartbeats (``beat/r``, under each rank's
    torchrun number): when each last went up, timed on rank 0's clock (no skew between
    hosts). A value first seen now counts from now: a rank is found lost only after
    HEARTBEAT_LOST_S of watching it stand still. A beat counts only if its tag checks
    and it is higher than the last one seen (an earlier beat written again is not a beat)."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self._seen: dict[int, tuple[int, float]] = {}

    def stopped(self, rank: int) -> bool:
        value = read_signed(self.store, f"beat/{rank}")
        beat = int(value) if value is not None and value.isdigit() else 0
        now = time.monotonic()
        if rank not in self._seen or beat > self._seen[rank][0]:
            self._seen[rank] = (beat, now)
        return now - self._seen[rank][1] > HEARTBEAT_LOST_S


def find_lost(
    store: dist.Store, generation: int, ranks: list[int], is_dead: Callable[[int], bool], deadline: float
) -> list[int]:
    """Rank 0, after the group broke: the ranks that will not check in to ``generation``,
    found by is_dead(r) (a spawned rank's process has ended; a torchrun rank's heartbeat
    stopped). Returns once every rank has checked in or been found lost; ranks still
    silent at ``deadline`` (monotonic) are lost too: they hang.
    """
    pending = set(ranks)
    lost: list[int] = []
    while pending:
        for r in sorted(pending):
            if checked_in(store, generation, r):
                pending.discard(r)
            elif is_dead(r):
                pending.discard(r)
                lost.append(r)
        if pending and time.monotonic() > deadline:
            lost += pending
            break
        if pending:
            time.sleep(POLL_S)
    return sorted(lost)


def start_heartbeat(connect: Callable[[], dist.Store], rank: int) -> None:
    """A torchrun rank: count up ``beat/rank`` every HEARTBEAT_S, on a connection of its
    own, for as long as the process lives (rank 0 reads it to tell a lost rank from a slow one)."""

    def beat() -> None:
        try:
            store = connect()
            n = 0
            while True:
                n += 1
                store.set(f"beat/{rank}", str(n))
                time.sleep(HEARTBEAT_S)
        except Exception:
            return  # the store is gone: rank 0 with it

    threading.Thread(target=beat, name=f"ctxpar-heartbeat-{rank}", daemon=True).start()
