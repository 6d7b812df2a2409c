"""The engine's side of constrained decoding (the grammars themselves: ctxpar/engine/sample/grammar.py).

A constrained request is held until its grammar is compiled (in the backend's
worker process, so a new schema does not stall the requests already running),
then scheduled like any other; each step masks its logits row before
sampling (StepSampler), and the scheduler advances its matcher by the token
sampled, after the commit (Scheduler.update_from_output).
A request whose grammar takes longer than the backend's compile timeout to
compile fails alone.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import torch

from ctxpar.engine.request import Request, RequestGroup
from ctxpar.engine.sample.grammar import GrammarBackend, GrammarLimits, apply_bitmasks
from ctxpar.engine.sample.grammar_cache import DEFAULT_MAX_SPEC_BYTES, DEFAULT_WORKER_MEMORY
from ctxpar.structured_params import StructuredOutputsParams


class StructuredOutputs:
    """The engine's side of constrained decoding: grammars for new requests,
    requests held until theirs is compiled, masks before sampling."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._args = (tokenizer, vocab_size, stop_token_ids)
        self.limits = GrammarLimits()
        self._backend: GrammarBackend | None = None  # made (and xgrammar imported) on first use
        self._lock = threading.Lock()  # the server's event loop may make it first
        self.compiling: list[RequestGroup] = []  # added, waiting for their grammar
        self._since: dict[int, float] = {}  # id of a compiling group -> when it was first seen waiting

    def configure(
        self,
        cache_bytes: int,
        compile_timeout: float,
        max_spec_bytes: int = DEFAULT_MAX_SPEC_BYTES,
        memory_bytes: int = DEFAULT_WORKER_MEMORY,
    ) -> None:
        """The grammar cache's bound in bytes, the seconds a compile may take, the longest spec
        and the compiler's memory (the server's flags); before the first constrained request."""
        if self._backend is not None:
            raise RuntimeError("configure the grammar backend before its first use")
        self.limits = GrammarLimits(cache_bytes, compile_timeout, max_spec_bytes, memory_bytes)

    @property
    def compile_timeout(self) -> float:
        return self.limits.compile_timeout

    @property
    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                self._backend = GrammarBackend(*self._args, self.limits)
            return self._backend

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """Its compile (CtxparError at once for a spec over the size cap), in the worker process."""
        return self.backend.compile(spec)

    def take_ready(self, block: bool) -> list[tuple[RequestGroup, BaseException | None]]:
        """The held groups whose grammar is compiled now, each with the compile error if it
        failed (or the timeout's, once it has taken too long). block: wait (briefly) for one
        when nothing else could run."""
        if not self.compiling:
            self._since.clear()
            return []
        futures = [g.samples[0].grammar.compiled for g in self.compiling]  # type: ignore[union-attr]
        if block:
            wait(futures, timeout=0.05, return_when=FIRST_COMPLETED)
        now = time.monotonic()
        since = {id(g): self._since.get(id(g), now) for g in self.compiling}
        self._since = since
        done = [f.done() for f in futures]  # read once: a compile may finish between two reads
        late = [not d and now - since[id(g)] > self.compile_timeout for g, d in zip(self.compiling, done)]
        ready = [(g, self._error(f)) for g, f, d in zip(self.compiling, futures, done) if d]
        ready += [(g, self.backend.timeout_error()) for g, t in zip(self.compiling, late) if t]
        self.compiling = [g for g, d, t in zip(self.compiling, done, late) if not d and not t]
        return ready

    def _error(self, compiled: Future) -> BaseException | None:
        # A compile given up on (the server cancels one whose request timed out) is a timeout here too.
        return self.backend.timeout_error() if compiled.cancelled() else compiled.exception()

    def mask(self, logits: torch.Tensor, requests: list[Request]) -> None:
        """Mask in place the rows of logits (S, V) whose request (row i: requests[i]) is constrained."""
        grammars = [r.grammar for r in requests]
        if any(g is not None for g in grammars):
            for g in grammars:
                if g is not None:
                    g.ready(self.backend)
            apply_bitmasks(self.backend, logits, grammars)

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
