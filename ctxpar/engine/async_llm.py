"""AsyncLLM: vLLM's asyncio engine API, over one engine loop.

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=...))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=16), request_id="0"):
        ...

One thread owns the LLMEngine and steps it while work exists: a thread of its
own (the default), or the caller's, which gives it up to ``run_engine_loop()``
(``ctxpar serve`` runs it on the main thread: torch steps ran slower on a
secondary thread there, and signals arrive on the main one). Coroutines never
touch the engine's state: they post commands (add a batch, abort) to a
thread-safe inbox and read their outputs from an asyncio queue that the engine
thread feeds with ``call_soon_threadsafe`` (submission.py: what crosses;
output_router.py: which queue each request's outputs go to). So a slow consumer
never stalls a step, a step never blocks the event loop, and requests arriving
while others decode join the next step (continuous batching is the engine's
own). Every request that has work is stepped in every step, so no generator
starves another.

A generator that is closed, cancelled or abandoned before its request finishes
aborts it (its KV blocks are freed within a step). If a step raises (a rank
died, or a bug), the engine is not trusted again: ``errored`` becomes True,
every waiting generator and every later call raises ``EngineDeadError`` with
the reason (``dead_error``). An idle loop asks the engine for its ranks'
health at each wake-up, so a rank lost between requests is noticed within
IDLE_POLL_S, not by the next request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Any

from ctxpar.engine.arg_utils import EngineArgs
from ctxpar.engine.input_processor import EngineRequest
from ctxpar.engine.llm_engine import LLMEngine, ModelConfig
from ctxpar.engine.metrics import Metric, StatLogger
from ctxpar.engine.output_router import OutputRouter, send
from ctxpar.engine.rank_recovery import RankRecovery
from ctxpar.engine.submission import AbortRequests, AddBatch, Command, Sink, StopLoop, Submission
from ctxpar.errors import RankFailure
from ctxpar.inputs import PromptType
from ctxpar.outputs import RequestOutput
from ctxpar.sampling_params import SamplingParams

logger = logging.getLogger("ctxpar")

IDLE_POLL_S = 0.5  # an idle loop wakes this often (signal handlers run, rank health is checked)


class EngineDeadError(RuntimeError):
    """The engine failed or was shut down; it takes no more requests."""


class AsyncLLM:
    """An asyncio front over one LLMEngine (see the module docstring)."""

    def __init__(
        self,
        llm_engine: LLMEngine,
        *,
        start_engine_loop: bool = True,
        stat_loggers: Iterable[StatLogger] = (),
        owns_engine: bool = False,
    ) -> None:
        """llm_engine: the engine to drive (an LLM's ``llm_engine`` may be shared).
        start_engine_loop: step it on a thread of its own; False: the caller runs
        ``run_engine_loop()``. owns_engine: ``shutdown()`` also closes the engine."""
        self.llm_engine = llm_engine
        llm_engine.stat_loggers.extend(stat_loggers)
        self.dead_error: EngineDeadError | None = None  # why the engine stopped taking requests
        self._owns_engine = owns_engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outputs = OutputRouter(llm_engine)  # engine thread only
        self._lock = threading.Lock()  # orders `dead_error` against posting to the inbox
        self._ids = itertools.count()
        self._running = False
        self._thread: threading.Thread | None = None
        if start_engine_loop:
            self._thread = threading.Thread(target=self.run_engine_loop, name="ctxpar-engine", daemon=True)
            self._thread.start()

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, start_engine_loop: bool = True, stat_loggers: Iterable[StatLogger] = ()
    ) -> AsyncLLM:
        return cls(
            LLMEngine(engine_args), start_engine_loop=start_engine_loop, stat_loggers=stat_loggers, owns_engine=True
        )

    # -- state ---------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._running and self.dead_error is None

    @property
    def is_stopped(self) -> bool:
        return self.dead_error is not None

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def rank_recovery(self) -> RankRecovery:
        """Lost ranks found (in a step, or by the idle health check) and recovered, and
        whether a recovery runs now (read from any thread: plain counters)."""
        return self.llm_engine.rank_recovery

    async def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    async def get_model_config(self) -> ModelConfig:
        return self.llm_engine.get_model_config()

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine failed (vLLM's check_health). A lost
        rank is found by the engine thread: in a step, or at an idle wake-up."""
        self._check_alive()

    async def get_metrics(self) -> list[Metric]:
        return self.llm_engine.get_metrics()  # totals and the snapshot the engine thread last took

    # -- requests (the event loop's side) ---------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        lora_request: None = None,
        trace_headers: Any = None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs as it runs (by its output_kind); the last one is
        finished. Leaving the loop early (break, cancellation, an exception, or
        dropping the generator) aborts the request."""
        LLMEngine.check_options(lora_request, priority)
        request = self.llm_engine.process_inputs(prompt, sampling_params)
        submission = self.submit([request], [request_id])
        async for _, out in submission.outputs():
            yield out

    def submit(self, requests: list[EngineRequest], request_ids: list[str] | None = None) -> Submission:
        """Queue requests that LLMEngine.process_inputs made, as one batch: they
        enter the same step, all or none. Call from a coroutine of the event loop
        that reads the outputs."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        if request_ids is None:
            base = f"{next(self._ids)}"
            request_ids = [f"{base}-{i}" for i in range(len(requests))]
        sink = Sink(loop, asyncio.Queue(), list(request_ids))
        self._post(AddBatch(sink, requests, time.time()))
        return Submission(self.abort_nowait, request_ids, sink.queue)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests; their generators end (with no further output)."""
        self.abort_nowait([request_id] if isinstance(request_id, str) else list(request_id))

    def abort_nowait(self, request_ids: list[str]) -> None:
        if request_ids:
            self._post(AbortRequests(request_ids), check=False)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    def _post(self, command: Command, check: bool = True) -> None:
        with self._lock:
            if check:
                self._check_alive()
            self._inbox.put(command)

    # -- the engine thread -----------------------------------------------------------

    def run_engine_loop(self) -> None:
        """Step the engine until ``shutdown``; on the thread that is to own it."""
        engine = self.llm_engine
        self._running = True
        try:
            while True:
                # Wait for commands when there is nothing to step (or nothing may be
                # stepped); with a timeout, so that signal handlers get to run.
                commands: list[Command] = []
                if self.dead_error is not None or not engine.has_unfinished_requests():
                    try:
                        commands.append(self._inbox.get(timeout=IDLE_POLL_S))
                    except queue.Empty:
                        if self.dead_error is None:
                            self._guard(engine.check_health)
                        continue
                while True:
                    try:
                        commands.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                for cmd in commands:
                    if isinstance(cmd, StopLoop):
                        self._fail_all(cmd.reason)
                        return
                    if self.dead_error is not None:
                        continue  # adds are refused once dead (_post); _fail_all ended the rest
                    if isinstance(cmd, AddBatch):
                        self._outputs.add(cmd)
                    else:
                        self._outputs.abort(cmd.request_ids)
                if self.dead_error is not None or not engine.has_unfinished_requests():
                    continue
                outputs = self._guard(engine.step)
                for out in outputs or []:
                    self._outputs.deliver(out)
        finally:
            self._running = False

    def _guard(self, call: Callable[[], list[RequestOutput] | None]) -> list[RequestOutput] | None:
        """call(), or None once it raised: a dead rank (RankFailure) or a bug, after
        which the engine is not trusted again."""
        try:
            return call()
        except Exception as e:
            # Clients (and /health) read `why`: a lost rank's own account (it names the rank and
            # how it went); any other exception's text (paths, values) only the log gets, traced.
            lost_rank = isinstance(e, RankFailure)
            logger.error("the engine failed: %s: %s", type(e).__name__, e, exc_info=not lost_rank)
            why = str(e) if lost_rank else f"{type(e).__name__}; the server log has the details"
            self._fail_all(f"the engine failed and takes no more requests; restart it ({why})")
            return None

    def _fail_all(self, why: str) -> None:
        with self._lock:
            self.dead_error = self.dead_error or EngineDeadError(why)
        # Commands posted before `dead_error` was set are failed too: none waits forever.
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, AddBatch):
                send(cmd.sink, self.dead_error)
        self._outputs.fail_all(self.dead_error)

    # -- lifetime ---------------------------------------------------------------------

    def shutdown(self, reason: str = "the engine was shut down") -> None:
        """Fail what is in flight (with ``reason``), stop the loop (and the engine, if
        this owns it). An AsyncLLM left running ends with the process: its loop
        thread is a daemon, and so are its spawned ranks."""
        self._post(StopLoop(reason), check=False)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self._owns_engine:
            self.llm_engine.close()


AsyncLLMEngine = AsyncLLM  # vLLM's earlier name
