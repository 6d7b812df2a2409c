"""One copy of the packed weights per host, in pages every PCP rank maps.

P ranks on one host would otherwise hold P copies of the weights. One
shared copy saves that memory, and when ranks run a layer at about the same
time (they meet at its KV all-gather) the one that reads it second mostly
finds it in the shared L3 cache, so the bus carries it once; each rank
still reads every weight through its own cores (docs/benchmarks.md, "Ranks
on one host").

Rank 0 copies its packed weights (layers/linear.py's PanelWeight, fp32 or
bf16 on the CPU, and QuantWeight's blocks, scales and offsets) into a shared
segment; every rank then points its weights at views of it, and frees its
private copy. The weights are those of the same
model files on every rank (the launcher checks the config), so which rank's
copy is kept does not matter.
"""

from __future__ import annotations

import warnings

from torch import nn

from ctxpar.errors import RankFailure
from ctxpar.layers.weight_arena import WeightArena
from ctxpar.parallel.comm import PCPGroup
from ctxpar.parallel.host_shm import SHM_DIR, free_bytes, shared_segment, wait_keys


def share_weights(model: nn.Module, group: PCPGroup, name: str = "weights") -> int:
    """Point `model`'s packed weights at one shared copy (every rank calls this,
    with the same model). Returns the bytes shared (0: nothing to share).
    name: the segment's (and its store keys'), one per model a rank holds."""
    arena = WeightArena.of(model)
    total = arena.total
    group.store.set(f"{name}/bytes/{group.rank}", str(total))
    wait_keys(group.store, [f"{name}/bytes/{k}" for k in range(group.size)])
    if {int(group.store.get(f"{name}/bytes/{k}")) for k in range(group.size)} != {total}:
        raise RankFailure("the PCP ranks loaded weights of different sizes; every rank must load the same model")
    if total == 0 or not _room_on_every_rank(group, total, name):
        return 0
    arena.point_at(shared_segment(group.store, group.rank, group.size, name, total, arena.fill))
    return total


def _room_on_every_rank(group: PCPGroup, total: int, name: str) -> bool:
    """Whether /dev/shm can hold the weights (rank 0 decides for all). A small one
    (docker's default is 64 MiB) is no error: each rank then keeps its own copy."""
    if group.rank == 0:
        room = free_bytes() >= total
        if not room:
            warnings.warn(
                f"ctxpar: {SHM_DIR} has {free_bytes() >> 20} MiB free, too little for one shared copy of "
                f"the weights ({total >> 20} MiB): each PCP rank keeps its own. Enlarge it (docker run "
                "--shm-size) to share them.",
                stacklevel=2,
            )
        group.store.set(f"{name}/share", "1" if room else "0")
    wait_keys(group.store, [f"{name}/share"])
    return group.store.get(f"{name}/share") == b"1"
