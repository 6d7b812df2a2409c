"""The processes of the rendezvous security tests (parallel/test_rendezvous_security.py):
a victim rank doing what a worker does with what it reads from its peers, and
an attacker posing as rank 0. They are targets of multiprocessing spawn, so
they live in a module a spawned process can import by name.

Each victim reports what happened to it through ``results``: ("received", what)
when it accepted something, ("refused", the error's text) when it refused."""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
import torch.distributed as dist

from ctxpar.parallel.auth import TAG_BYTES, PlanSeal, Unauthenticated
from ctxpar.parallel.comm import Launch, PCPGroup
from ctxpar.parallel.host_shm import shared_segment
from ctxpar.parallel.private_file import UnsafeFile
from ctxpar.parallel.rendezvous_store import open_store
from ctxpar.parallel.signed_store import SignedStore

SECRET = b"the launch secret of the victim's ranks"
PREFIX = "victim/"
SEGMENT_BYTES = 4096


class CreatesFile:
    """Unpickling it creates the file at ``path``: the payload of a forged plan
    (any code could run in its place)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.path, "w"))


def _report(results: Any, outcome: tuple[str, str]) -> None:
    results.put(outcome)
    results.close()
    results.join_thread()
    os._exit(0)  # leave the broken group without waiting for its peer


def plan_victim(port: int, shm: bool, results: Any) -> None:
    """Rank 1 of a real group of two: waits for rank 0's next message, as a worker
    does between steps (through the shared pages, or gloo's control group)."""
    os.environ["CTXPAR_SHM"] = "1" if shm else "0"
    store = open_store("127.0.0.1", port, is_master=False)
    group = PCPGroup(1, 2, torch.device("cpu"), store, Launch(SECRET, spawned=True))
    try:
        _report(results, ("received", repr(group.broadcast_object())))
    except Unauthenticated as e:
        _report(results, ("refused", str(e)))


def plan_attacker(port: int, shm: bool, how: str, path: str) -> None:
    """Rank 0 of that group, sending a plan whose unpickling creates ``path``:
    how="forged": without the secret (it tags with a guess); how="tampered": a
    genuine header and tag (as if recorded on the wire) on a payload swapped in flight."""
    os.environ["CTXPAR_SHM"] = "1" if shm else "0"
    os.environ["CTXPAR_COLLECTIVE_TIMEOUT_S"] = "10"  # the victim leaves mid-message
    store = open_store("127.0.0.1", port, is_master=False)
    secret = SECRET if how == "tampered" else b"a guess at the secret"
    group = PCPGroup(0, 2, torch.device("cpu"), store, Launch(secret, spawned=True))
    evil = pickle.dumps(CreatesFile(path))
    try:
        if how == "forged":
            group.broadcast_object(CreatesFile(path))
        else:
            header, genuine = PlanSeal(SECRET).seal(bytes(len(evil)))  # a message of the same length
            _send_raw(group, header)
            _send_raw(group, genuine[:TAG_BYTES] + evil)
    except Exception:
        pass  # the victim left: what it did is its report
    os._exit(0)


def _send_raw(group: PCPGroup, data: bytes) -> None:
    """Bytes into the victim's channel as rank 0's next message part."""
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if group.shm is not None:
        group.shm.broadcast_(tensor)
    else:
        dist.broadcast(tensor, src=0, group=group.control)


def segment_victim(port: int, results: Any) -> None:
    """Rank 1 mapping the shared segment that rank 0 names on the store, as every
    worker does at start-up (through its launch's signed store)."""
    signed = SignedStore(open_store("127.0.0.1", port, is_master=False), SECRET)
    store = dist.PrefixStore(PREFIX, signed)
    try:
        segment = shared_segment(store, 1, 2, "channel", SEGMENT_BYTES)
        _report(results, ("received", f"mapped {segment.numel()} bytes"))
    except (Unauthenticated, UnsafeFile) as e:
        _report(results, ("refused", str(e)))
