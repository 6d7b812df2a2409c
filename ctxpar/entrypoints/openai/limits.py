"""The server's limits on what clients may ask of it, and the admission gate
that enforces the concurrency and queue limits.

A generation request holds one of ``limit_concurrency`` slots from the moment
it is handed to the engine until its response is sent; beyond those, up to
``max_queued_requests`` wait (first come, first served) for a slot, and any
more are refused at once with a 503 and a Retry-After header, so that an
overload is a fast, explicit answer rather than an ever longer queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from ctxpar.entrypoints.openai.protocol import ApiError

# What a refused client is told to wait: slots free as requests finish, which
# at the server's usual pace is well within a second or two.
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ServerLimits:
    """``ctxpar serve``'s client limits (its flags of the same names)."""

    limit_concurrency: int = 256  # generation requests in the engine at once
    max_queued_requests: int = 256  # generation requests waiting for one of those slots
    max_body_size: int = 16 << 20  # bytes of one request body
    timeout_client: int = 30  # s to send a whole body; s a response may wait for its reader
    timeout_graceful_shutdown: int = 10  # s requests in flight get after SIGTERM


def overloaded(limits: ServerLimits) -> ApiError:
    return ApiError(
        503,
        f"the server is at its limit ({limits.limit_concurrency} requests running and "
        f"{limits.max_queued_requests} queued): retry after {RETRY_AFTER_S} s",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


class Admission:
    """Slots for generation requests, with a bounded queue (event loop only)."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self._slots = asyncio.Semaphore(limits.limit_concurrency)
        self.queued = 0  # waiting for a slot
        self.running = 0  # holding one

    def full(self) -> bool:
        """No free slot and no room in the queue: a new request would be refused."""
        return self._slots.locked() and self.queued >= self.limits.max_queued_requests

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a slot for the block, after waiting in the queue for one (the
        caller has checked ``full()``: a full queue is refused, not joined)."""
        self.queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.queued -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()
