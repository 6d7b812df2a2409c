"""ClientGuard: the ASGI middleware between uvicorn and the routes that makes a
hostile or broken client cost the server a bounded amount and nobody else anything.

- The API key is checked first (access.py), on the headers alone: a client
  without it gets a 401 before a byte of its body is read, and its connection
  is closed. Without a key, the Host header is checked instead (access.py).
- A POST's body must be declared JSON (Content-Type: application/json), else a
  415 before it is read: every body the API takes is JSON, and a web page can
  send a text/plain or form body to a local server without asking, never JSON.
- The body is read here, once, before any route runs: a declared or actual size
  over ``max_body_size`` is a 413, a body that has not arrived within
  ``timeout_client`` (a slow sender) a 408, and a client that leaves half-way
  simply ends its request (no route sees a ClientDisconnect, so nothing is
  logged). Routes then read the body from memory. Every body counts against
  the server's BodyBudget (limits.py) from its first byte (its declared length,
  when it has one) until its response is sent; past the budget, a 503.
- Generation and tokenizer requests (POST /v1/completions, /v1/chat/completions,
  /tokenize, /detokenize) go through the Admission gate (limits.py): at most
  ``limit_concurrency`` at once, a bounded queue, then 503 + Retry-After.
- A response that its client stops reading (a slow reader) is dropped after
  ``timeout_client`` s without progress (one warning in the log names the client);
  dropping the stream closes its output generator, which aborts the request and
  frees its KV blocks.
- A route's unexpected exception (a bug) is answered here with a 500 that says
  where it failed and a request id, the traceback logged under that id
  (failures.py); the exception's text stays in the log.
- When uvicorn's graceful shutdown runs out of time it cancels the requests
  left (by then the engine has ended every generation with an error, see
  shutdown.py: what is left waits on its client); the cancellation ends them
  here, with a 503 for one not yet answered, instead of a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ctxpar.entrypoints.openai.access import Access
from ctxpar.entrypoints.openai.failures import internal_error
from ctxpar.entrypoints.openai.limits import Admission, BodyBudget, overloaded
from ctxpar.entrypoints.openai.protocol import ApiError
from ctxpar.entrypoints.openai.server_limits import ServerLimits

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

logger = logging.getLogger("ctxpar")

GATED = {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}


class _ClientLeft(Exception):
    """The client disconnected before its body was whole."""


class _SlowReader(Exception):
    """The client read none of its response for ``timeout_client`` s."""


class ClientGuard:
    """The ASGI middleware (see the module's docstring)."""

    def __init__(
        self, app: ASGIApp, limits: ServerLimits, admission: Admission, access: Access, budget: BodyBudget
    ) -> None:
        self.app, self.limits, self.admission, self.access, self.budget = app, limits, admission, access, budget

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sender = _Sender(send, self.limits.timeout_client)
        try:
            await self._handle(scope, receive, sender)
        except _ClientLeft:
            pass  # the client went away: nobody to answer
        except _SlowReader:
            # Nobody to answer either; the operator learns who held a response that long.
            client = "{}:{}".format(*scope["client"]) if scope.get("client") else "a client"
            logger.warning(
                "%s %s: dropped %s that read none of its response for %s s (--timeout-client)",
                scope["method"],
                scope["path"],
                client,
                self.limits.timeout_client,
            )
        except asyncio.CancelledError:
            # uvicorn cancels requests only when its graceful shutdown ran out of
            # time: the server is stopping on purpose; answer one still unanswered.
            if not sender.started:
                await _answer(send, _before_body(ApiError(503, "the server is shutting down")))

    async def _handle(self, scope: MutableMapping[str, Any], receive: Receive, send: _Sender) -> None:
        refused = self.access.refuse(scope) or _not_json(scope)
        if refused is not None:
            await _answer(send, _before_body(refused))
            return
        gated = scope["method"] == "POST" and scope["path"] in GATED
        held = _Held(self.budget)
        try:
            try:
                if gated:
                    self._admit()
                body = await self._read_body(scope, receive, held)
                if gated:
                    self._admit()  # the queue may have filled while the body arrived
            except ApiError as e:
                await _answer(send, e)
                return
            replay = _replay(body, receive)
            if not gated:
                await self._route(scope, replay, send)
                return
            async with self.admission.slot():  # no await since _admit: the queue has room
                await self._route(scope, replay, send)
        finally:
            held.release()

    async def _route(self, scope: MutableMapping[str, Any], receive: Receive, send: _Sender) -> None:
        try:
            await self.app(scope, receive, send)
        except (_ClientLeft, _SlowReader):
            raise
        except Exception as e:
            # Caught here, not by an app exception handler: Starlette re-raises from those,
            # and uvicorn would log the traceback a second time, without the request id.
            error = internal_error(scope["method"], scope["path"], e)
            if not send.started:
                await _answer(send, error)

    def _admit(self) -> None:
        if self.admission.full():
            raise _before_body(overloaded(self.limits))

    async def _read_body(self, scope: MutableMapping[str, Any], receive: Receive, held: _Held) -> bytes:
        limit = self.limits.max_body_size
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > limit:
                raise _before_body(_too_large(limit))
            held.up_to(int(declared))  # the whole body's room now: refused before any of it is read

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
                held.up_to(size)  # a body of no declared length (chunked): as it comes
                chunks.append(chunk)
                if not msg.get("more_body", False):
                    return b"".join(chunks)

        try:
            return await asyncio.wait_for(read(), self.limits.timeout_client)
        except asyncio.TimeoutError:
            timeout = self.limits.timeout_client
            raise _before_body(ApiError(408, f"the request body did not arrive within {timeout:g} s")) from None


class _Held:
    """What one request holds of the BodyBudget, given back once its response is sent."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget, self.nbytes = budget, 0

    def up_to(self, nbytes: int) -> None:
        """Hold ``nbytes`` in all (no more than that is taken); a 503 past the budget."""
        if nbytes > self.nbytes:
            try:
                self.budget.take(nbytes - self.nbytes)
            except ApiError as e:
                raise _before_body(e) from None
            self.nbytes = nbytes

    def release(self) -> None:
        self.budget.give_back(self.nbytes)
        self.nbytes = 0


def _not_json(scope: MutableMapping[str, Any]) -> ApiError | None:
    """A 415 for a POST whose body is not declared JSON."""
    if scope["method"] != "POST":
        return None
    declared = dict(scope["headers"]).get(b"content-type", b"").decode("latin-1")
    if declared.split(";", 1)[0].strip().lower() == "application/json":
        return None
    return ApiError(
        415,
        f"the body must be JSON, sent with 'Content-Type: application/json' (got {declared[:100]!r})",
    )


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
