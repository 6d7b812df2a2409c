"""How ``ctxpar serve`` stops on SIGINT/SIGTERM: gracefully, and within a bound in every case.

A Python signal handler runs on the main thread, between bytecodes, so a long
engine step there would delay it: the signals are instead written to a pipe
(``signal.set_wakeup_fd``, at once, by whichever thread the kernel picks) that
a thread of its own reads.

1. First signal: uvicorn stops accepting; requests in flight keep being
   stepped and answered.
2. After ``grace`` s: the engine ends what is still running with an error
   ("the server is shutting down"): a stream gets an error event and [DONE],
   a plain request a 503. uvicorn, given one more second, then cancels what
   still waits on a client (a slow sender or reader), and the engine's exit
   stops the ranks.
3. At ``grace`` + STOP_MARGIN_S, or at a second signal: whatever is stuck
   (a hung rank, a step that does not end), the rank processes are killed and
   the process exits (status 1), saying so.

What it says goes to stderr, which may be a pipe whose reader is gone (the
benchmark or supervisor that started the server was killed): a failed write
must not stop the shutdown (``say``).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Protocol

from ctxpar.engine.async_llm import AsyncLLM

STOP_MARGIN_S = 5.0  # after the grace period: for uvicorn's last cancellations and the ranks' stop
# uvicorn's own timeout runs this much past ours, so the engine's error events go first (whole seconds: uvicorn's type)
UVICORN_MARGIN_S = 1
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Stoppable(Protocol):  # uvicorn.Server
    should_exit: bool


class Shutdown:
    """``start()`` on the main thread; ``finish()`` once everything has stopped."""

    def __init__(self, server: _Stoppable, engine: AsyncLLM, grace: float) -> None:
        self.server, self.engine, self.grace = server, engine, grace
        self._done = threading.Event()
        self._timers: list[threading.Timer] = []

    def start(self) -> None:
        read, write = os.pipe()
        os.set_blocking(write, False)
        for sig in SIGNALS:
            signal.signal(sig, lambda signum, frame: None)  # the pipe gets the signal; nothing else to do
        signal.set_wakeup_fd(write)
        threading.Thread(target=self._watch, args=(read,), name="ctxpar-signals", daemon=True).start()

    def finish(self) -> None:
        """Everything stopped in time: no timer may fire now."""
        self._done.set()
        for t in self._timers:
            t.cancel()

    def _watch(self, pipe: int) -> None:
        _next_signal(pipe)
        self.server.should_exit = True
        say(f"stopping; requests in flight get {self.grace:g} s")
        self._timers = [
            _timer(self.grace, self._end_requests),
            _timer(self.grace + STOP_MARGIN_S, self._kill, "did not stop in time"),
        ]
        _next_signal(pipe)
        self._kill("a second signal")

    def _end_requests(self) -> None:
        self.engine.shutdown(f"the server is shutting down: the request was still running after {self.grace:g} s")

    def _kill(self, why: str) -> None:
        if self._done.is_set():
            return
        say(f"{why}: killing the PCP ranks and exiting")
        for p in multiprocessing.active_children():
            p.kill()
        os._exit(1)


def say(message: str) -> None:
    """``ctxpar: message`` on stderr. If stderr is gone (EPIPE: its reader exited), fd 2 is pointed
    at /dev/null, so that neither this nor the interpreter's last flush at exit raises."""
    try:
        print(f"ctxpar: {message}", file=sys.stderr, flush=True)
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stderr.fileno())
        os.close(devnull)


def _next_signal(pipe: int) -> None:
    """Wait for SIGINT or SIGTERM (the pipe gets every signal that has a Python handler: skip others)."""
    while os.read(pipe, 1)[0] not in SIGNALS:
        pass


def _timer(seconds: float, call: Callable[..., None], *args: str) -> threading.Timer:
    t = threading.Timer(seconds, call, args)
    t.daemon = True
    t.start()
    return t
