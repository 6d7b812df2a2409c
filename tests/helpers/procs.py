"""What a process maps of ctxpar's shared files, and the addresses it listens on, read from /proc;
and a process that ends as a killed worker does."""

from __future__ import annotations

import ctypes
import ipaddress
import os
import threading
from typing import Any


def shm_mappings(pid: int) -> dict[str, int]:
    """pid's mappings of ctxpar's shared files: path -> bytes mapped."""
    sizes: dict[str, int] = {}
    for line in open(f"/proc/{pid}/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith("/dev/shm/ctxpar-"):
            lo, hi = (int(a, 16) for a in fields[0].split("-"))
            sizes[fields[5]] = sizes.get(fields[5], 0) + hi - lo
    return sizes


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """The (address, port) pairs that pid's TCP sockets listen on, IPv4 and IPv6."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)  # the header
            for line in f:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    addr, port = fields[1].split(":")
                    found.add((_address(bytes.fromhex(addr), width), int(port, 16)))
    return found


def _address(raw: bytes, width: int) -> str:
    # /proc/net/tcp* print each 32-bit word of the address in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
    return str(ipaddress.ip_address(words))


def main_thread_leaves_first(release: Any, code: int) -> None:
    """A spawned process's target: end its main thread while another waits for ``release``
    (a multiprocessing Event), then exits with ``code``: how a killed worker looks (its main
    thread a zombie) until its last thread has left."""

    def later() -> None:
        release.wait()
        os._exit(code)

    threading.Thread(target=later).start()
    ctypes.CDLL(None).pthread_exit(None)
