"""ClientGuard: the ASGI middleware between uvicorn and the routes that makes a
hostile or broken client cost the server a bounded amount and nobody else anything.

- The body is read here, once, before any route runs: a declared or actual size
  over ``max_body_size`` is a 413, a body that has not arrived within
  ``timeout_client`` (a slow sender) a 408, and a client that leaves half-way
  simply ends its request (no route sees a ClientDisconnect, so nothing is
  logged). Routes then read the body from memory.
- Generation requests (POST /v1/completions, /v1/chat/completions) go through
  the Admission gate (limits.py): at most ``limit_concurrency`` at once, a
  bounded queue, then 503 + Retry-After.
- A response that its client stops reading (a slow reader) is dropped after
  ``timeout_client`` s without progress; dropping the stream closes its output
  generator, which aborts the request and frees its KV blocks.
- When uvicorn's graceful shutdown runs out of time it cancels the requests
  left (by then the engine has ended every generation with an error, see
  shutdown.py: what is left waits on its client); the cancellation ends them
  here, with a 503 for one not yet answered, instead of a traceback.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ctxpar.entrypoints.openai.limits import Admission, ServerLimits, overloaded
from ctxpar.entrypoints.openai.protocol import ApiError

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

GATED = {"/v1/completions", "/v1/chat/completions"}


class _ClientLeft(Exception):
    """The client disconnected before its body was whole."""


class _SlowReader(Exception):
    """The client read none of its response for ``timeout_client`` s."""


class ClientGuard:
    def __init__(self, app: ASGIApp, limits: ServerLimits, admission: Admission) -> None:
        self.app, self.limits, self.admission = app, limits, admission

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sender = _Sender(send, self.limits.timeout_client)
        try:
            await self._handle(scope, receive, sender)
        except (_ClientLeft, _SlowReader):
            pass  # the client went away, or was dropped: nobody to answer
        except asyncio.CancelledError:
            # uvicorn cancels requests only when its graceful shutdown ran out of
            # time: the server is stopping on purpose; answer one still unanswered.
            if not sender.started:
                await _answer(send, _before_body(ApiError(503, "the server is shutting down")))

    async def _handle(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        gated = scope["method"] == "POST" and scope["path"] in GATED
        try:
            if gated:
                self._admit()
            body = await self._read_body(scope, receive)
            if gated:
                self._admit()  # the queue may have filled while the body arrived
        except ApiError as e:
            await _answer(send, e)
            return
        replay = _replay(body, receive)
        if not gated:
            await self.app(scope, replay, send)
            return
        async with self.admission.slot():  # no await since _admit: the queue has room
            await self.app(scope, replay, send)

    def _admit(self) -> None:
        if self.admission.full():
            raise _before_body(overloaded(self.limits))

    async def _read_body(self, scope: MutableMapping[str, Any], receive: Receive) -> bytes:
        limit = self.limits.max_body_size
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _before_body(_too_large(limit))

        async def read() -> bytes:
            chunks, size = [], 0
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    raise _ClientLeft()
                chunk = msg.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise _before_body(_too_large(limit))
                chunks.append(chunk)
                if not msg.get("more_body", False):
                    return b"".join(chunks)

        try:
            return await asyncio.wait_for(read(), self.limits.timeout_client)
        except asyncio.TimeoutError:
            timeout = self.limits.timeout_client
            raise _before_body(ApiError(408, f"the request body did not arrive within {timeout:g} s")) from None


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than the server's limit of {limit} bytes (--max-body-size)")


def _before_body(e: ApiError) -> ApiError:
    # Answered before the body was read whole: the connection cannot carry another request.
    e.headers["Connection"] = "close"
    return e


async def _answer(send: Send, e: ApiError) -> None:
    body = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _replay(body: bytes, receive: Receive) -> Receive:
    """The routes' receive: the body read here, then the client's own messages (its disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


class _Sender:
    """The routes' send: notes when the response has started, and drops a client
    that reads none of it for ``timeout`` s (its send stays blocked)."""

    def __init__(self, send: Send, timeout: float) -> None:
        self.send, self.timeout = send, timeout
        self.started = False

    async def __call__(self, message: Message) -> None:
        self.started = True
        try:
            await asyncio.wait_for(self.send(message), self.timeout)
        except asyncio.TimeoutError:
            raise _SlowReader() from None
