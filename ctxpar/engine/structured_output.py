"""The engine's side of constrained decoding (the grammars themselves: ctxpar/engine/grammar.py).

A constrained request is held until its grammar is compiled (on the backend's
worker thread, so a new schema does not stall the requests already running),
then scheduled like any other; each step masks its logits row before
sampling and advances its matcher by the token sampled, after the commit.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import torch

from ctxpar.engine.grammar import GrammarBackend, apply_bitmasks
from ctxpar.engine.request import Request, RequestGroup
from ctxpar.structured_params import StructuredOutputsParams


class StructuredOutputs:
    """The engine's side of constrained decoding: grammars for new requests,
    requests held until theirs is compiled, masks before sampling, tokens after."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._args = (tokenizer, vocab_size, stop_token_ids)
        self._backend: GrammarBackend | None = None  # made (and xgrammar imported) on first use
        self.compiling: list[RequestGroup] = []  # added, waiting for their grammar

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            self._backend = GrammarBackend(*self._args)
        return self._backend

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """Check ``spec`` now (CtxparError if invalid) and compile it on the worker thread."""
        return self.backend.compile(spec)

    def take_ready(self, block: bool) -> list[tuple[RequestGroup, BaseException | None]]:
        """The held groups whose grammar is compiled now, each with the compile error if it
        failed. block: wait (briefly) for one when nothing else could run."""
        if not self.compiling:
            return []
        futures = [g.samples[0].grammar.compiled for g in self.compiling]  # type: ignore[union-attr]
        if block:
            wait(futures, timeout=0.05, return_when=FIRST_COMPLETED)
        done = [f.done() for f in futures]  # read once: a compile may finish between two reads
        ready = [(g, f.exception()) for g, f, d in zip(self.compiling, futures, done) if d]
        self.compiling = [g for g, d in zip(self.compiling, done) if not d]
        return ready

    def mask(self, logits: torch.Tensor, requests: list[Request]) -> None:
        """Mask in place the rows of logits (S, V) whose request (row i: requests[i]) is constrained."""
        grammars = [r.grammar for r in requests]
        if any(g is not None for g in grammars):
            for g in grammars:
                if g is not None:
                    g.ready(self.backend)
            apply_bitmasks(self.backend, logits, grammars)

    @staticmethod
    def accept(requests: list[Request], tokens: list[int]) -> None:
        """Advance each constrained request's matcher by the token it just sampled."""
        for r, t in zip(requests, tokens):
            if r.grammar is not None:
                r.grammar.accept(t)

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
