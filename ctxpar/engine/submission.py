"""What crosses between AsyncLLM's coroutines and its engine thread (async_llm.py).

Coroutines post commands to the engine thread's inbox: ``AddBatch``,
``AbortRequests``, ``StopLoop``. The engine thread sends each batch's outputs
to the batch's ``Sink``, an asyncio queue on the submitter's event loop, with
an ``Aborted`` note for each request aborted, or the exception that ended it;
``Submission`` reads them there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ctxpar.engine.input_processor import EngineRequest
from ctxpar.outputs import RequestOutput


class ClientGone(Exception):
    """The consumer went away (an HTTP client disconnected) before its requests finished."""


@dataclass
class Sink:
    """Where one submission's outputs go."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    request_ids: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Aborted:
    """Sent to a submission whose request was aborted: its generator ends."""

    request_id: str


@dataclass(frozen=True)
class AddBatch:
    """Queue requests, all or none, as the requests ``sink.request_ids``."""

    sink: Sink
    requests: list[EngineRequest]
    arrival_time: float  # time.time() when submitted


@dataclass(frozen=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True)
class StopLoop:
    """Fail what is in flight with ``reason`` and end the engine loop."""

    reason: str


Command = AddBatch | AbortRequests | StopLoop


class Submission:
    """One batch's requests: iterate for (index, output) until all finish."""

    def __init__(self, abort: Callable[[list[str]], None], request_ids: list[str], q: asyncio.Queue) -> None:
        """abort: aborts requests, from the event loop (AsyncLLM.abort_nowait)."""
        self.abort = abort
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.queue = q
        self.unfinished = set(request_ids)

    async def outputs(self, disconnected: asyncio.Future | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs as they come; raises ClientGone once ``disconnected`` is done,
        EngineDeadError if the engine fails. Leaving early aborts what is unfinished."""
        try:
            while self.unfinished:
                get = asyncio.ensure_future(self.queue.get())
                waits = {get} if disconnected is None else {get, disconnected}
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not get.done():
                        get.cancel()
                if not get.done() or get.cancelled():
                    raise ClientGone()
                item = get.result()
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, Aborted):
                    self.unfinished.discard(item.request_id)
                    continue
                if item.finished:
                    self.unfinished.discard(item.request_id)
                yield self.index[item.request_id], item
        finally:
            self.abort(sorted(self.unfinished))
            self.unfinished = set()
