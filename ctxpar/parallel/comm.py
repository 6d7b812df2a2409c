"""The PCP process group: the collectives context parallelism needs, and
what a launch gives it to form from (Launch, torchrun's environment).

Two groups over the same ranks:
- the data group (gloo on CPU, NCCL on CUDA) carries per-layer KV all-gathers
  and the gather of sampled hidden states, with a short timeout so a dead
  rank turns into an error instead of a hang. CPU ranks that are all on one
  host use shared pages instead (shm_channel.py), with the same timeout and
  a check that notices a dead peer within milliseconds;
- the control group (always gloo) carries rank 0's step plans. Workers wait
  on it while the engine is idle, so on their side it has no practical
  timeout (a dead rank 0 closes its sockets and their wait fails at once);
  on rank 0's side it has the same short timeout as the data group. Ranks
  on one host send the plans through the shared pages too (workers wait
  there without a timeout, and notice a dead rank 0 within milliseconds).

Ranks meet through a TCPStore (rendezvous_store.py); the gloo groups of
ranks that rank 0 spawned listen on the loopback interface alone.

Nothing a rank reads from a peer is trusted unchecked: the store's values are
tagged with the launch secret (signed_store.py), and so is every message rank
0 sends (auth.PlanSeal), checked before it is decoded; its tags are bound to
the launch's nonce and the group's generation, so a message of another launch
or generation fails its check. Under torchrun (ranks on several hosts) so is
every rank's contribution to a gloo data collective (sealed_collectives.py),
checked before it is used; NCCL's are not. Messages are bytes here: what
they say is ctxpar/worker/plan_wire.py's to encode, as data.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ctxpar.parallel import group_links
from ctxpar.parallel.auth import PlanSeal, context
from ctxpar.parallel.host_shm import on_one_host
from ctxpar.parallel.sealed_collectives import SealedCollectives
from ctxpar.parallel.shm_channel import ShmChannel

# torch >= 2.13 names it all_gather_single; older releases all_gather_into_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

DATA_TIMEOUT_S = 30  # a collective with a silent rank fails after this (CTXPAR_COLLECTIVE_TIMEOUT_S)
STARTUP_TIMEOUT_S = 600  # every rank must have loaded its model within this


def data_timeout_s() -> float:
    """Seconds after which a collective with a silent rank fails: DATA_TIMEOUT_S, or the
    environment's CTXPAR_COLLECTIVE_TIMEOUT_S (read when a group forms: a hung rank is
    told from a slow one only by time, and slow links or huge steps may need longer)."""
    value = os.environ.get("CTXPAR_COLLECTIVE_TIMEOUT_S")
    return float(value) if value else float(DATA_TIMEOUT_S)


@dataclass(frozen=True)
class Launch:
    """What the ranks of one launch share besides the store: the secret that tags
    their messages (auth.py), whether rank 0 spawned them all on this host (then
    gloo listens on the loopback interface only), and the launch's nonce, fresh
    for each launch (drawn by rank 0, or agreed by torchrun's ranks): every tag
    and store key of the launch is bound to it."""

    secret: bytes = field(repr=False)
    spawned: bool
    nonce: bytes = b""


class PCPGroup:
    def __init__(
        self, rank: int, size: int, device: torch.device, store: dist.Store, launch: Launch, generation: str = "g0"
    ) -> None:
        """Form the groups. Called by every rank once all have loaded their
        models (the start-up handshake), so a short timeout suffices.
        generation: which forming of the group in the launch this is (regroup.py
        names them); with the launch's nonce, it keys every tag of the group."""
        self.rank, self.size, self.device = rank, size, device
        self.timeout_s = data_timeout_s()
        self.launch = launch
        ctx = context(launch.nonce, generation.encode())
        self.seal = PlanSeal(launch.secret, ctx)
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=self.timeout_s)
        before = group_links.socket_inodes()
        with _gloo_interface(_loopback_interface() if launch.spawned else None):
            dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
            self.data = dist.new_group(backend=backend, timeout=timeout)
            # Timeouts are per process: rank 0 gives up on a silent worker after
            # the timeout, while workers wait for rank 0's next plan indefinitely.
            control_timeout = timeout if rank == 0 else timedelta(days=365)
            self.control = dist.new_group(backend="gloo", timeout=control_timeout)
        # gloo's connections to the other ranks (cut_links): the sockets the groups opened.
        self._links = group_links.socket_inodes() - before
        self.store = store
        # Ranks of one CPU host exchange data through shared pages (and share their weights).
        one_host = device.type == "cpu" and on_one_host(store, rank, size)
        self.shm = ShmChannel(store, rank, size, self.timeout_s) if one_host else None
        # torchrun's ranks may be on several hosts: their gloo data collectives carry
        # tags of the launch secret (sealed_collectives.py). Spawned ranks (one host)
        # and NCCL do not; an empty secret (CTXPAR_INSECURE_CLUSTER) has nothing to tag with.
        tagged = backend == "gloo" and not launch.spawned and bool(launch.secret) and self.shm is None
        self.sealed = SealedCollectives(launch.secret, ctx, rank, size, self.data) if tagged else None
        # Seconds spent in collectives, waiting included (for benchmarks).
        self.comm_seconds = 0.0  # data: KV all-gathers and hidden-state gathers
        self.control_seconds = 0.0  # control: plan broadcasts
        # Data-group collectives made so far, by kind ("all_gather", "all_to_all", "gather_to_first", "broadcast").
        self.num_collectives: Counter[str] = Counter()

    @property
    def one_host(self) -> bool:
        """Every rank on this CPU host: data through shared pages, weights shared."""
        return self.shm is not None

    @contextmanager
    def _data_collective(self, kind: str) -> Iterator[None]:
        """Count a data collective and the seconds spent in it."""
        t0 = time.perf_counter()
        yield
        self.num_collectives[kind] += 1
        self.comm_seconds += time.perf_counter() - t0

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(n, ...) on every rank -> (P*n, ...): rank k's rows at [k*n, (k+1)*n)."""
        with self._data_collective("all_gather"):
            if self.shm is not None:
                return self.shm.all_gather(x)
            if self.sealed is not None:
                return self.sealed.all_gather(x)
            out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
            _all_gather(out, x.contiguous(), group=self.data)
            return out

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """(P, m, ...) on every rank -> (P, m, ...): row k of the result is rank k's row ``self.rank``."""
        with self._data_collective("all_to_all"):
            if self.shm is not None:
                return self.shm.all_to_all(x)
            if self.sealed is not None:
                return self.sealed.all_to_all(x)
            out = torch.empty_like(x)
            dist.all_to_all_single(out, x.contiguous(), group=self.data)
            return out

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """(m, ...) on every rank -> (P, m, ...) on rank 0, None elsewhere."""
        with self._data_collective("gather_to_first"):
            if self.shm is not None:
                return self.shm.gather_to_first(x)
            if self.sealed is not None:
                return self.sealed.gather_to_first(x)
            parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
            dist.gather(x.contiguous(), parts, dst=0, group=self.data)
            return torch.stack(parts) if parts is not None else None

    def broadcast_(self, x: torch.Tensor) -> None:
        """Rank 0's x into every other rank's x (same shape and dtype, contiguous), in place."""
        with self._data_collective("broadcast"):
            if self.shm is not None:
                self.shm.broadcast_(x)
            elif self.sealed is not None:
                self.sealed.broadcast_(x)
            else:
                dist.broadcast(x, src=0, group=self.data)

    def broadcast_message(self, data: bytes | None = None) -> memoryview:
        """Rank 0 sends ``data``; every rank returns it (the others a view of what they
        received). Rank 0 gives up on silent ranks after DATA_TIMEOUT_S; the others wait
        for it indefinitely (as long as it lives). The others return it only once its
        HMAC checks, and raise auth.Unauthenticated for a forged or replayed one."""
        t0 = time.perf_counter()
        # A tagged header (the length), then the tagged payload: on one host through
        # the shared pages (microseconds, against gloo's milliseconds), else the control group.
        wait = None if self.rank == 0 else math.inf
        if self.rank == 0:
            assert data is not None  # rank 0 always has something to say
            header, payload = self.seal.seal(data)
            self._broadcast_bytes(_as_tensor(header), wait)
            self._broadcast_bytes(_as_tensor(payload), None)
            received = memoryview(data)
        else:
            head = torch.empty(PlanSeal.HEADER_BYTES, dtype=torch.uint8)
            self._broadcast_bytes(head, wait)
            body = torch.empty(self.seal.open_header(head.numpy().tobytes()), dtype=torch.uint8)
            self._broadcast_bytes(body, None)
            received = self.seal.open_payload(body.numpy().data)  # a view: no copy
        self.control_seconds += time.perf_counter() - t0
        return received

    def _broadcast_bytes(self, data: torch.Tensor, timeout_s: float | None) -> None:
        """Rank 0's uint8 tensor into the others' (same size) on the control path;
        timeout_s: the shared pages' wait for rank 0 (None: the channel's)."""
        if self.shm is not None:
            self.shm.broadcast_(data, timeout_s=timeout_s)
        else:
            dist.broadcast(data, src=0, group=self.control)

    def cut_links(self) -> int:
        """Shut down this rank's ends of the gloo groups' connections (group_links.py): every
        collective waiting on them, in any thread, fails at once. For a peer lost without
        closing its sockets; the group is broken afterwards. Returns the links cut."""
        return group_links.cut(self._links)

    def close(self) -> None:
        """Destroy the groups, and drop this object's references to them now: a gloo group is
        freed (its worker threads joined, their last works' tensors released) while the
        interpreter still runs, not during its finalization, where a worker's decref that
        needs the GIL ends the thread by force and aborts the process."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self.sealed = None
        for name in ("data", "control"):  # a second close finds them gone
            self.__dict__.pop(name, None)


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _loopback_interface() -> str:
    """The name of this host's loopback interface ("lo" on Linux)."""
    names = {name for _, name in socket.if_nameindex()}
    return "lo" if "lo" in names else "lo0"


@contextmanager
def _gloo_interface(name: str | None) -> Iterator[None]:
    """gloo reads the interface to listen on from its environment as a group
    forms; set it for that moment only (rank 0 is the user's process)."""
    if name is None:
        yield
        return
    old = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ["GLOO_SOCKET_IFNAME"]
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = old


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent hosts the store; every rank is a client


def torchrun_env() -> TorchrunEnv | None:
    """The torch.distributed environment set by torchrun (or a launcher like it), else None."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return TorchrunEnv(
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        master_addr=env["MASTER_ADDR"],
        master_port=int(env["MASTER_PORT"]),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )
