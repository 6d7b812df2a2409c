"""The server's connections, bounded before a request exists: uvicorn's h11 protocol
with a deadline for the request line and headers, and a cap on open connections.

uvicorn closes an idle keep-alive connection, but its timer stops at the first byte:
a client that sends a request line and then one header line a second (slowloris)
holds its connection, and a file descriptor, for ever. Here each connection must
deliver a whole request head within ``timeout_header`` s of being opened (or of its
previous response); past it, a 408 and the connection is closed. Past
``max_connections`` open at once, a new connection is closed as soon as it is
accepted, so descriptors cannot run out. What comes after the head is ClientGuard's
(guard.py): the body within ``timeout_client`` s, the response read within as much.
That cap holds only if the process may open that many descriptors besides its own
(``reserve_descriptors``): else accept() fails with EMFILE first, and uvicorn logs
and retries while every new client hangs.
"""

from __future__ import annotations

import asyncio
import resource

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ctxpar.errors import CtxparError

# Descriptors the server holds besides its clients' connections: the listening socket,
# the ranks' sockets and pipes, the grammar compiler's, the model's and the log's files.
OWN_DESCRIPTORS = 256

_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def bounded_h11(timeout_header: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's ``http`` protocol class with these bounds (``uvicorn.Config(http=...)``)."""

    class BoundedH11(H11Protocol):
        header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.close()  # connection_lost forgets it
                return
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's head is due within the same time

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()  # a whole head arrived: the body's deadline is ClientGuard's

        def _arm(self) -> None:
            self._disarm()
            self.header_deadline = self.loop.call_later(timeout_header, self._expired)

        def _disarm(self) -> None:
            if self.header_deadline is not None:
                self.header_deadline.cancel()
                self.header_deadline = None

        def _expired(self) -> None:
            self.header_deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.write(_TIMEOUT)
                self.transport.close()

    return BoundedH11


def reserve_descriptors(max_connections: int) -> int:
    """Raise this process's soft descriptor limit to fit ``max_connections`` connections
    beside its own descriptors (up to the hard limit, as an unprivileged process may);
    CtxparError naming both fixes when even the hard limit is too low. Returns the soft limit."""
    needed = max_connections + OWN_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise CtxparError(
                f"--max-connections {max_connections} needs {needed} file descriptors ({OWN_DESCRIPTORS} are the "
                f"server's own), but this process may open at most {hard} (`ulimit -Hn`); lower --max-connections "
                f"to {max(hard - OWN_DESCRIPTORS, 1)} or raise the hard limit (e.g. LimitNOFILE= in a systemd unit)"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
        soft = needed
    return soft
