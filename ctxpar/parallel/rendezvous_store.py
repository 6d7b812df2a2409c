"""The rendezvous store: the TCPStore the ranks meet on before they form a group.

Rank 0 hosts it when it spawns the workers (listening on master_addr alone,
loopback by default); torchrun's agent hosts it under torchrun. The start-up
handshake on it (see executor/startup.py) is polled, so a rank that dies while
starting is noticed within a poll interval instead of at the end of a long
blocking wait. Every value on it is tagged with the launch secret (signed_store.py).
"""

from __future__ import annotations

import errno
import socket
from datetime import timedelta

import torch.distributed as dist

from ctxpar.errors import CtxparError, RankFailure

RENDEZVOUS_TIMEOUT_S = 30  # connecting to rank 0's (or torchrun's) store


def port_in_use(port: int) -> CtxparError:
    """The error for a busy master_port (found before the model load, or by the store)."""
    return CtxparError(
        f"master_port {port} is already in use (another ctxpar or torchrun job?); "
        "pass a free port (--master-port), or leave it unset to pick one"
    )


def host_store(addr: str, port: int) -> dist.TCPStore:
    """Host the spawned ranks' rendezvous store, listening on ``addr`` alone (port 0:
    any free port, read back from store.port). TCPStore binds every interface of
    the host when left to itself; here it serves a socket bound to addr."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does
        listener.bind(sockaddr)
        listener.listen(socket.SOMAXCONN)
    except OSError as e:
        listener.close()
        if e.errno == errno.EADDRINUSE:
            raise port_in_use(port) from None
        raise
    bound = listener.getsockname()[1]
    return open_store(addr, bound, is_master=True, listen_fd=listener.detach())  # the store owns it now


def open_store(addr: str, port: int, is_master: bool, listen_fd: int | None = None) -> dist.TCPStore:
    """Host (is_master) or join the rendezvous store at addr:port (port 0:
    any free port, read back from store.port); listen_fd: a socket bound to port
    for the host to listen on. Never blocks for other ranks: they are waited
    for by polling, see startup.py."""
    try:
        return dist.TCPStore(
            addr,
            port,
            None,
            is_master,
            timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
            wait_for_workers=False,
            master_listen_fd=listen_fd,
        )
    except dist.DistNetworkError as e:
        if is_master and "EADDRINUSE" in str(e):
            raise port_in_use(port) from None
        raise RankFailure(
            f"could not reach the rendezvous at {addr}:{port} (gave up after retrying for {RENDEZVOUS_TIMEOUT_S} s) "
            f"({str(e).splitlines()[0]}); check the master address and port and that no firewall blocks them"
        ) from None
