"""How the ranks meet again after one was lost (spawned ranks only).

Each recovery is a new *generation* of the group. Rank 0 respawns the ranks
that died with the generation's number, then announces it; the survivors,
whose group broke under them, wait for that announcement and meet the
respawned ranks under the generation's own store keys, with the start-up
handshake of startup.py (``started/r``, ``ready/r``, ``verdict``)::

    rank 0                     survivor k                   respawned rank j
    -----------------------    -------------------------    ------------------
    leaves the broken group    its collective fails:
    spawns rank j (gen g)      leaves the group, waits      loads the model
    sets recover/g  ------->   sees recover/g
    lead(g/...)                follow(g/...)                follow(g/...)
    PCPGroup(g/...)            PCPGroup(g/...)              PCPGroup(g/...)
    keeps its runner           keeps its runner (KV cache)  a fresh runner

The survivors keep their KV caches; the engine then restores what the
respawned ranks lost (ctxpar/engine/recovery.py).
"""

from __future__ import annotations

import time

import torch.distributed as dist

from ctxpar.errors import RankFailure
from ctxpar.executor.startup import POLL_S
from ctxpar.parallel.comm import STARTUP_TIMEOUT_S


def generation_store(store: dist.Store, generation: int) -> dist.Store:
    """The keys the ranks of a generation meet under (generation 0: the executor's own)."""
    return store if generation == 0 else dist.PrefixStore(f"g{generation}/", store)


def announce(store: dist.Store, generation: int) -> None:
    """Rank 0: the survivors are to meet under ``generation``."""
    store.set(f"recover/{generation}", "")


def await_recovery(store: dist.Store, generation: int, rank: int) -> None:
    """Survivor ``rank``, whose group broke: wait until rank 0 announces ``generation``.
    RankFailure when rank 0 is gone (its store with it) or stays silent."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        while not store.check([f"recover/{generation}"]):
            if time.monotonic() > deadline:
                raise RankFailure(f"rank 0 did not re-form the PCP group within {STARTUP_TIMEOUT_S} s")
            time.sleep(POLL_S)
    except RankFailure:
        raise
    except Exception as e:  # the store's connection: rank 0 is gone
        raise RankFailure(f"PCP rank {rank} lost rank 0 (its rendezvous store is gone: {type(e).__name__})") from e
