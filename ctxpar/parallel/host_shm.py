"""Shared pages for the PCP ranks of one host (/dev/shm).

Rank 0 creates a file in /dev/shm (mode 0600), fills it, and names it in the
rendezvous store; every other rank maps it, once it proves to be that private
file (private_file.py), and says so; rank 0 then unlinks the file.
The mappings outlive the name, so nothing is left behind however the ranks
end. Used for the ranks' one shared copy of the weights
(shared_weights.py) and for the collectives' exchange buffers
(shm_channel.py).

All of it needs every rank on one host, which ``on_one_host`` checks (host
name, boot id and mount namespace: two containers with one host name on
different machines are two hosts), and the kernels' barrier. ``CTXPAR_SHM=0`` turns
it off: the ranks then keep private weights and use the data group's
collectives (gloo), as ranks on several hosts always do.
"""

from __future__ import annotations

import mmap
import os
import socket
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ctxpar import kernels
from ctxpar.errors import RankFailure
from ctxpar.parallel.private_file import create_private, open_private
from ctxpar.parallel.signed_store import wait_signed

SHM_DIR = Path("/dev/shm")
WAIT_S = 60  # ranks are all started when this runs; a missing one has died


def enabled() -> bool:
    return os.environ.get("CTXPAR_SHM", "1") != "0"


def _host_id() -> str:
    """Equal for processes that see the same /dev/shm: one boot of one machine,
    one mount namespace (``ip netns exec`` makes a new one, as do containers)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        mounts = os.readlink("/proc/self/ns/mnt")
    except OSError:
        return f"unknown/{uuid.uuid4()}"  # cannot tell: count as a host of its own
    return f"{socket.gethostname()}/{boot}/{mounts}"


def on_one_host(store: dist.Store, rank: int, size: int) -> bool:
    """Whether all `size` ranks run on this host with shared pages usable (every rank calls this)."""
    usable = enabled() and SHM_DIR.is_dir() and kernels.available()
    store.set(f"host/{rank}", _host_id() if usable else f"none/{rank}")
    keys = [f"host/{k}" for k in range(size)]
    wait_keys(store, keys)
    return len({store.get(k) for k in keys}) == 1


def shared_segment(
    store: dist.Store, rank: int, size: int, name: str, nbytes: int, fill: Callable[[torch.Tensor], None] | None = None
) -> torch.Tensor:
    """A (nbytes,) uint8 tensor over pages that every rank maps (every rank calls
    this, in the same order, with the same name and size). Rank 0 creates them
    zeroed and calls ``fill`` on them before the others map them."""
    if rank == 0:
        if free_bytes() < nbytes:
            raise RankFailure(
                f"{SHM_DIR} has {free_bytes() >> 20} MiB free, {nbytes >> 20} MiB are needed for "
                "the ranks' shared pages; enlarge it (docker: --shm-size) or set CTXPAR_SHM=0"
            )
        path = SHM_DIR / f"ctxpar-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            segment = _map(path, nbytes, create=True)
            if fill is not None:
                fill(segment)
            store.set(f"shm/{name}", str(path))
            wait_keys(store, [f"shm/{name}/mapped/{k}" for k in range(1, size)], presence=True)
        finally:
            path.unlink(missing_ok=True)
        return segment
    wait_keys(store, [f"shm/{name}"])
    segment = _map(Path(store.get(f"shm/{name}").decode()), nbytes, create=False)
    store.set(f"shm/{name}/mapped/{rank}", "")
    return segment


def _map(path: Path, nbytes: int, create: bool) -> torch.Tensor:
    # The name comes from the store: only a private file of the agreed size is mapped.
    fd = create_private(path) if create else open_private(path, nbytes, SHM_DIR)
    try:
        if create:
            os.posix_fallocate(fd, 0, nbytes)  # reserve the pages now: a full /dev/shm fails here, not as SIGBUS later
        buf = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return torch.frombuffer(buf, dtype=torch.uint8)  # keeps `buf` (the mapping) alive


def free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def wait_keys(store: dist.Store, keys: list[str], presence: bool = False) -> None:
    """Wait until every key is set (presence keys: with a value whose tag checks, so a
    forged one is not counted; a forged value is refused when read); RankFailure after WAIT_S."""
    try:
        if presence:
            wait_signed(store, keys, timedelta(seconds=WAIT_S))
        else:
            store.wait(keys, timedelta(seconds=WAIT_S))
    except Exception as e:  # the store's timeout or a lost connection
        raise RankFailure(
            f"a PCP rank did not reach the shared-memory set-up within {WAIT_S} s ({str(e).splitlines()[0]})"
        ) from None
