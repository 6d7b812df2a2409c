"""Checks made before any model is loaded: can the ranks be started the way
this process was asked to start them? Each refusal is a CtxparError naming
the limit and the fix, on every rank, before minutes of loading are spent.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.multiprocessing as mp

from ctxpar.config import EngineConfig
from ctxpar.costmodel.profiles import load_hardware
from ctxpar.device import resolve_device
from ctxpar.errors import CtxparError
from ctxpar.parallel.cluster_secret import cluster_secret
from ctxpar.parallel.comm import torchrun_env
from ctxpar.parallel.rendezvous_store import port_in_use

# Spawning more CPU ranks than cores only time-slices them; a few are still
# allowed on small machines (tests, trying PCP out), no more.
MIN_CPU_RANK_LIMIT = 8


def max_local_ranks(device: torch.device) -> int:
    """How many ranks may be spawned on this machine: one per GPU on CUDA;
    on CPU one per usable core, but at least MIN_CPU_RANK_LIMIT."""
    if device.type == "cuda":
        return torch.cuda.device_count()
    return max(MIN_CPU_RANK_LIMIT, len(os.sched_getaffinity(0)))


def check_launch(config: EngineConfig) -> None:
    """What can be refused before any model is loaded, on every rank:

    - under torchrun the world size rules: every process it started must be a
      PCP rank, else each would run an engine of its own (pcp_size=1
      included) and print everything once per process; and the ranks must
      share a secret (parallel/cluster_secret.py);
    - when spawning: a spawned rank re-importing a main module that creates
      an LLM (no main guard), more ranks than the machine holds, a
      master_addr that is not this machine's and a busy master_port;
    - a hardware_profile that is neither a built-in nor a readable profile file.
    """
    if config.hardware_profile is not None:
        load_hardware(config.hardware_profile)  # the PCP policy's, read by every rank at start-up
    env = torchrun_env()
    if env is not None:
        if env.world_size != config.pcp_size:
            raise CtxparError(
                f"torchrun started {env.world_size} processes but pcp_size is {config.pcp_size} (this is rank "
                f"{env.rank}); pass --pcp {env.world_size} (pcp_size={env.world_size}), or start "
                f"{config.pcp_size} process(es) in all (--nnodes x --nproc-per-node)"
            )
        if config.pcp_size > 1:
            cluster_secret()
        return
    if config.pcp_size == 1:
        return
    _refuse_in_bootstrapping_child()
    _check_fits_machine(config)
    check_local_address(config.master_addr)
    if config.master_port is not None:
        check_port_free(config.master_port)


def _check_fits_machine(config: EngineConfig) -> None:
    """Refuse before spawning anything: each rank is a process with its own model."""
    device = resolve_device(config.device)
    n, limit = config.pcp_size, max_local_ranks(device)
    if n <= limit:
        return
    if device.type == "cuda":
        why = f"needs one GPU per rank but {limit} are visible"
    else:
        cores = len(os.sched_getaffinity(0))
        why = (
            f"is more CPU ranks than this machine runs: the limit is {limit} (its {cores} usable cores, "
            f"at least {MIN_CPU_RANK_LIMIT}; more ranks than cores only share them)"
        )
    raise CtxparError(f"pcp_size={n} {why}; use pcp_size <= {limit}, or torchrun to spread the ranks over machines")


def _refuse_in_bootstrapping_child() -> None:
    """A spawned rank re-imports the main module; a script without a main
    guard then creates an LLM in the child too. Exit with one line (rank 0
    names this rank and the fix) instead of loading a model and then getting
    multiprocessing's traceback."""
    if getattr(mp.current_process(), "_inheriting", False):
        print(
            "ctxpar: a spawned PCP rank is importing a main module that creates an LLM; "
            'put that code under `if __name__ == "__main__":`',
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)


def check_local_address(addr: str) -> None:
    """Spawned ranks all run on this machine and meet at rank 0 there, so
    master_addr must resolve to one of its addresses. Checked up front: a
    foreign address would otherwise leave the store's connect retrying."""
    fix = "use 127.0.0.1 (the default) or an address of this machine; to span machines start the ranks with torchrun"
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise CtxparError(f"master_addr {addr!r} does not resolve ({e}); {fix}") from None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0))  # binds only to an address of this machine
            return
        except OSError:
            continue
    raise CtxparError(f"master_addr {addr!r} is not an address of this machine; {fix}")


def check_port_free(port: int) -> None:
    """Fail early, before any model is loaded, on a busy master_port (the
    store's own bind still reports one taken in the meantime)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store does
        try:
            s.bind(("", port))
        except OSError:
            raise port_in_use(port) from None
