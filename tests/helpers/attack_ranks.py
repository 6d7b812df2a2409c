"""The processes of the rendezvous security tests (parallel/test_rendezvous_security.py):
a victim rank doing what a worker does with what it reads from its peers, and
an attacker posing as rank 0. They are targets of multiprocessing spawn, so
they live in a module a spawned process can import by name.

Each victim reports what happened to it through ``results``: ("received", what)
when it accepted something, ("refused", the error's text) when it refused."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ctxpar.executor.rank_worker import next_message
from ctxpar.parallel.auth import TAG_BYTES, PlanSeal, Unauthenticated, context
from ctxpar.parallel.comm import Launch, PCPGroup
from ctxpar.parallel.host_shm import shared_segment
from ctxpar.parallel.private_file import UnsafeFile
from ctxpar.parallel.rendezvous_store import host_store, open_store
from ctxpar.parallel.signed_store import SignedStore
from ctxpar.worker import plan_wire
from ctxpar.worker.plan_wire import MalformedMessage
from ctxpar.worker.step_plan import StepPlan

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


NONCE = b"the victim's launch nonce"


def a_plan() -> StepPlan:
    """A genuine step plan of two rows (a prompt chunk and a decode)."""
    return StepPlan(
        input_ids=np.arange(5, dtype=np.int64),
        num_scheduled_tokens=np.array([4, 1], dtype=np.int64),
        num_computed_tokens=np.array([0, 9], dtype=np.int64),
        is_prefilling=np.array([True, False]),
        needs_logits=np.array([True, True]),
        block_tables=[np.array([3], dtype=np.int64), np.array([1, 2], dtype=np.int64)],
    )


def plan_victim(port: int, shm: bool, results: Any, secret: bytes = SECRET, generation: str = "g0/") -> None:
    """Rank 1 of a real group of two (of ``generation`` of a launch): waits for rank 0's
    next message, as a worker does between steps (through the shared pages, or gloo's
    control group), and decodes it as a worker does."""
    os.environ["CTXPAR_SHM"] = "1" if shm else "0"
    store = open_store("127.0.0.1", port, is_master=False)
    launch = Launch(secret, spawned=bool(secret), nonce=NONCE)
    group = PCPGroup(1, 2, torch.device("cpu"), store, launch, generation)
    try:
        _report(results, ("received", repr(next_message(group))))
    except (Unauthenticated, MalformedMessage) as e:
        _report(results, ("refused", str(e)))


def plan_attacker(port: int, shm: bool, how: str, path: str) -> None:
    """Rank 0 of that group, sending what ``how`` says:
    "forged": a plan whose unpickling creates ``path``, without the secret (tagged with a guess);
    "tampered": that pickle under a genuine header and tag (as if recorded on the wire),
    its payload swapped in flight;
    "generation 0", "generation 1": a genuine plan, sent by rank 0 of generation 0 (or 1)
    of the victim's launch as its message 0 (as recorded from a group before a recovery);
    "insecure": that pickle, sealed with the key everyone has under CTXPAR_INSECURE_CLUSTER=1."""
    os.environ["CTXPAR_SHM"] = "1" if shm else "0"
    os.environ["CTXPAR_COLLECTIVE_TIMEOUT_S"] = "10"  # the victim leaves mid-message
    store = open_store("127.0.0.1", port, is_master=False)
    secret = {"forged": b"a guess at the secret", "insecure": b""}.get(how, SECRET)
    generation = "g1/" if how == "generation 1" else "g0/"  # the group's own, which keys its seal
    launch = Launch(secret, spawned=bool(secret), nonce=NONCE)
    group = PCPGroup(0, 2, torch.device("cpu"), store, launch, generation)
    evil = pickle.dumps(CreatesFile(path))
    try:
        if how in ("forged", "insecure"):
            group.broadcast_message(evil)
        elif how == "tampered":
            header, genuine = PlanSeal(SECRET, context(NONCE, b"g0/")).seal(bytes(len(evil)))  # as long as evil
            _send_raw(group, header)
            _send_raw(group, genuine[:TAG_BYTES] + evil)
        else:  # rank 0 of that generation, sending its first plan as rank 0 does
            group.broadcast_message(plan_wire.encode(a_plan()))
    except Exception:
        pass  # the victim left: what it did is its report
    os._exit(0)


def run_plan_attack(shm: bool, how: str, target: Path, victim: tuple = ()) -> tuple[str, str]:
    """Rank 1 (plan_victim, given ``victim``'s extra arguments) and an attacker posing as
    rank 0 (plan_attacker ``how``), both real processes; what rank 1 reports."""
    ctx = mp.get_context("spawn")
    store = host_store("127.0.0.1", 0)
    results = ctx.Queue()
    victim = ctx.Process(target=plan_victim, args=(store.port, shm, results, *victim))
    attacker = ctx.Process(target=plan_attacker, args=(store.port, shm, how, str(target)))
    victim.start()
    attacker.start()
    try:
        outcome = results.get(timeout=120)
    finally:
        for p in (victim, attacker):
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return outcome


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
