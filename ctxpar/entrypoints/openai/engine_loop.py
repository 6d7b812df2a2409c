"""The engine loop: one thread owns the Engine and steps it while work exists.

It is the process's main thread (the HTTP server runs in another): torch
steps ran slower on a secondary thread than on the main one when measured (CPU,
oneDNN/OpenMP), and the main thread is also where signals arrive.

HTTP handlers run on the asyncio event loop and never touch the engine's
state: they post commands (add a batch, abort a request) to a thread-safe
inbox, and read their outputs from an asyncio queue that the engine thread
feeds with ``call_soon_threadsafe``. So a slow client never stalls a step,
and a step never blocks the event loop. Requests arriving while others
decode join the next step (continuous batching is the engine's own).

If a step raises (a PCP rank died, or a bug), the engine is not trusted
again: every request in flight and every later one fails with the reason,
and /health answers 503 until the server is restarted.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ctxpar.entrypoints.openai.metrics import ServerMetrics
from ctxpar.outputs import RequestOutput
from ctxpar.sampling_params import SamplingParams

IDLE_POLL_S = 0.5


class EngineDead(RuntimeError):
    """The engine failed or was shut down; it takes no more requests."""


class ClientGone(Exception):
    """The HTTP client disconnected before its requests finished."""


@dataclass
class _Sink:
    """Where one HTTP request's outputs go, and per engine request, its timing."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    submitted: float
    last_token: dict[str, float] = field(default_factory=dict)  # request id -> time of its latest token


class EngineLoop:
    """Runs ``engine.step()`` on its own thread for the HTTP handlers."""

    def __init__(self, engine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.dead: str | None = None  # why the engine stopped taking requests
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # engine request id -> its sink (engine thread only)
        self._lock = threading.Lock()  # orders `dead` against posting to the inbox
        self._ids = itertools.count()

    def stop(self) -> None:
        """Make ``run`` fail what is still in flight and return (the caller closes the engine)."""
        self._post(("stop",), check=False)

    # -- the event loop's side ----------------------------------------------

    def submit(self, prompts: list[tuple[str | None, list[int], SamplingParams]]) -> Submission:
        """Queue validated prompts as one batch: they enter the same step."""
        loop = asyncio.get_running_loop()
        sink = _Sink(loop, asyncio.Queue(), time.perf_counter())
        base = f"{next(self._ids)}"
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        self._post(("add", sink, ids, prompts))
        return Submission(self, ids, sink.queue)

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._post(("abort", request_ids), check=False)

    def _post(self, command: tuple, check: bool = True) -> None:
        with self._lock:
            if check and self.dead is not None:
                raise EngineDead(self.dead)
            self._inbox.put(command)

    # -- the engine thread ----------------------------------------------------

    def run(self) -> None:
        """Step the engine for the handlers until ``stop``; call it on the main thread."""
        engine = self.engine
        while True:
            # Wait for commands when there is nothing to step (or nothing may
            # be stepped); with a timeout, so that signal handlers get to run.
            commands = []
            if self.dead is not None or not engine.has_unfinished_requests():
                try:
                    commands.append(self._inbox.get(timeout=IDLE_POLL_S))
                except queue.Empty:
                    continue
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for cmd in commands:
                if cmd[0] == "stop":
                    self._fail_all("the server is shutting down")
                    return
                if self.dead is None:
                    getattr(self, "_do_" + cmd[0])(*cmd[1:])
            if self.dead is not None or not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a dead rank (RankFailure) or a bug: the engine is not trusted again
                why = f"{type(e).__name__}: {e}"
                self._fail_all(f"the engine failed and takes no more requests; restart the server ({why})")
                continue
            now = time.perf_counter()
            # Gauges first: a client that sees a token sees metrics at least as fresh.
            self.metrics.observe_engine(engine)
            for out in outputs:
                self._deliver(out, now)

    def _do_add(self, sink: _Sink, ids: list[str], prompts: list) -> None:
        added = []
        try:
            for rid, (text, token_ids, params) in zip(ids, prompts):
                self.engine.add_request(token_ids, params, prompt=text, request_id=rid)
                added.append(rid)
                self._sinks[rid] = sink
        except Exception as e:  # validated before, so unexpected: all or nothing, and tell the client
            for rid in added:
                self._do_abort([rid])
            self._send(sink, e)

    def _do_abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self._sinks.pop(rid, None) is not None:
                self.engine.abort(rid)
        self.metrics.observe_engine(self.engine)

    def _deliver(self, out: RequestOutput, now: float) -> None:
        sink = self._sinks.get(out.request_id)
        if sink is None:
            return
        last = sink.last_token.get(out.request_id)
        if last is None:
            self.metrics.first_token(now - sink.submitted, len(out.prompt_token_ids))
        else:
            self.metrics.next_token(now - last)
        sink.last_token[out.request_id] = now
        if out.finished:
            del self._sinks[out.request_id]
            self.metrics.finished(out, now - sink.submitted)
        self._send(sink, out)

    def _send(self, sink: _Sink, item: object) -> None:
        try:
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)
        except RuntimeError:
            pass  # the event loop is closed: the server is exiting and nobody is listening

    def _fail_all(self, why: str) -> None:
        with self._lock:
            self.dead = self.dead or why
        # Commands posted before `dead` was set are failed too: none waits forever.
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                self._send(cmd[1], EngineDead(self.dead))
        for rid, sink in list(self._sinks.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                pass  # a broken engine: the requests are failed below all the same
            self._send(sink, EngineDead(self.dead))
        self._sinks.clear()
        self.metrics.observe_engine(self.engine)


class Submission:
    """One HTTP request's engine requests: iterate for (index, output) until all finish."""

    def __init__(self, engine_loop: EngineLoop, request_ids: list[str], q: asyncio.Queue) -> None:
        self.engine_loop = engine_loop
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.queue = q
        self.unfinished = set(request_ids)

    async def outputs(self, disconnected: asyncio.Future | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs as they come; raises ClientGone once ``disconnected`` is done,
        EngineDead if the engine fails. Leaving early aborts what is unfinished."""
        try:
            while self.unfinished:
                get = asyncio.ensure_future(self.queue.get())
                waits = {get} if disconnected is None else {get, disconnected}
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    raise ClientGone()
                item = get.result()
                if isinstance(item, Exception):
                    raise item
                if item.finished:
                    self.unfinished.discard(item.request_id)
                yield self.index[item.request_id], item
        finally:
            self.engine_loop.abort(sorted(self.unfinished))
            self.unfinished = set()
