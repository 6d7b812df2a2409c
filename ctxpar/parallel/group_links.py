"""A process group's TCP links, found as the group forms and cut on demand.

A gloo collective notices a dead peer when the peer's sockets close (its
kernel sends FIN or RST). A host that is lost without closing them (power
lost, a link cut, a process that a surviving child still holds the sockets
of) sends nothing: the collective waits out its whole timeout. Rank 0 learns
of such a loss sooner from the rank's heartbeat (executor/step_watch.py), and
then cuts its own ends of the group's links: ``shutdown`` on a socket wakes
every thread waiting on it, so the collective fails at once.

The group's links are the connected TCP sockets that appeared in this process
while the group formed (gloo connects its full mesh then), named by socket
inode, which outlives no socket (a file descriptor number may be reused).
"""

from __future__ import annotations

import os
import socket

_FD_DIR = "/proc/self/fd"


def _socket_fds() -> dict[int, int]:
    """This process's socket inodes -> a file descriptor of each (Linux; {} elsewhere)."""
    found: dict[int, int] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            found[int(target[len("socket:[") : -1])] = int(name)
    return found


def socket_inodes() -> set[int]:
    """The inodes of this process's open sockets now."""
    return set(_socket_fds())


def cut(inodes: set[int]) -> int:
    """Shut down, both ways, those of ``inodes`` that are still open connected TCP sockets
    of this process; returns how many. Their owners see their peer close."""
    count = 0
    for inode, fd in _socket_fds().items():
        if inode not in inodes:
            continue
        try:
            s = socket.socket(fileno=os.dup(fd))  # a duplicate: closing it leaves the owner's fd open
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
                s.getpeername()  # OSError for a listener: nothing to cut
                s.shutdown(socket.SHUT_RDWR)
                count += 1
        except OSError:
            pass
        finally:
            s.close()
    return count
