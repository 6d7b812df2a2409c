"""Constrained decoding on xgrammar: grammars compiled once, one matcher per request, a bitmask per step.

    InputProcessor ──► GrammarBackend.compile(spec)   a Future, cached by spec.key() in a bounded
                                                      LRU (grammar_cache.py); a spec over the size
                                                      cap fails at once
      compile thread ──► GrammarWorker: parse and compile in a process of its own, bounded in
                         time (killed past ``compile_timeout``) and memory (grammar_worker.py);
                         the compiled grammar comes back as xgrammar's JSON
    Engine.step: a request joins the scheduler once its grammar is compiled, or fails alone
      logits (S, V) ──► apply_bitmasks: each constrained row's matcher fills its row
                        of an (S, ceil(V/32)) int32 bitmask; one in-place masking of
                        all those rows sets disallowed logits to -inf
      sampler (logprobs, penalties, sampling all see the masked logits, as in vLLM)
      after the step commits: matcher.accept_token(token)

Nothing of a client's spec is parsed or compiled on the engine thread, nor on the
threads that tokenize and render requests: the engine thread only looks the compile
up. A step that fails advances no matcher (tokens are accepted only after the
commit), and preemption keeps a request's output tokens, so its matcher stays
valid: nothing has to be rolled back. xgrammar is imported only when the first
constrained request arrives.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ctxpar.engine.sample.grammar_cache import (
    DEFAULT_CACHE_BYTES,
    DEFAULT_COMPILE_TIMEOUT_S,
    DEFAULT_MAX_SPEC_BYTES,
    DEFAULT_WORKER_MEMORY,
    GrammarCache,
    key_bytes,
)
from ctxpar.engine.sample.grammar_worker import GrammarWorker
from ctxpar.errors import CtxparError
from ctxpar.structured_params import StructuredOutputsParams


@dataclass(frozen=True)
class GrammarLimits:
    """What one client's spec may cost (the server's --grammar-* flags)."""

    cache_bytes: int = DEFAULT_CACHE_BYTES  # compiled grammars kept, least recently used out first
    compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S  # s of one parse and compile
    max_spec_bytes: int = DEFAULT_MAX_SPEC_BYTES  # characters of one spec
    memory_bytes: int = DEFAULT_WORKER_MEMORY  # the compiler process's address space


class GrammarBackend:
    """xgrammar over the engine's tokenizer: compiles (in its worker process, cached) and hands out matchers."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], limits: GrammarLimits = GrammarLimits()
    ) -> None:
        if tokenizer is None:
            raise CtxparError("structured outputs need a tokenizer: this model has none")
        if not stop_token_ids:
            raise CtxparError(
                "structured outputs need an end-of-sequence token to end a complete structure, and this model "
                "defines none (eos_token_id in its config.json)"
            )
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        hf = getattr(tokenizer, "hf", tokenizer)  # a GGUF's own tokenizer: transformers' (models/gguf_tokenizer.py)
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.limits = limits
        self.compile_timeout = limits.compile_timeout
        self.cache = GrammarCache(limits.cache_bytes)
        self.worker = GrammarWorker(self.info.serialize_json(), limits.memory_bytes)
        self.worker.replace()  # started now: it imports xgrammar while the first spec is on its way
        # One thread: it talks to the worker process, one compile at a time, in order.
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ctxpar-grammar")

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """The compiled grammar of ``spec``, as a Future; the first request of a spec compiles
        it in the worker process, the others share the result. A spec over the size cap
        raises CtxparError at once; an invalid one fails its Future with one."""
        key = spec.key()
        size = key_bytes(key)
        if size > self.limits.max_spec_bytes:
            raise CtxparError(
                f"structured_outputs.{spec.kind} is {size} characters long: the server compiles at most "
                f"{self.limits.max_spec_bytes} (--max-grammar-bytes); simplify it"
            )
        return self.cache.get_or_compile(key, lambda: self.pool.submit(self._compile, spec))

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        # On the compile thread: deserializing costs a fraction of compiling, and is bounded by the spec's cap.
        text = self.worker.compile(spec, self.compile_timeout)
        return self.xgr.CompiledGrammar.deserialize_json(text, self.info)

    def timeout_error(self) -> CtxparError:
        """What a request whose grammar took longer than ``compile_timeout`` is told."""
        return CtxparError(
            f"the grammar did not compile within {self.compile_timeout:g} s (the server's --grammar-compile-timeout): "
            "simplify the schema, regex or grammar"
        )

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.worker.stop()


@dataclass
class RequestGrammar:
    """One request's (one sample's) place in its grammar."""

    compiled: Future
    matcher: Any = field(default=None)

    def ready(self, backend: GrammarBackend) -> bool:
        """True once compiled (the matcher is made then); raises the compile error if it failed."""
        if self.matcher is None:
            if not self.compiled.done():
                return False
            self.matcher = backend.matcher(self.compiled.result())
        return True

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise AssertionError(f"the grammar refused token {token} its own mask allowed")

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return bool(self.matcher.is_terminated())


def apply_bitmasks(backend: GrammarBackend, logits: torch.Tensor, grammars: list[RequestGrammar | None]) -> None:
    """Set to -inf, in place, every logit of logits (S, V) that row i's grammar
    does not allow next; rows whose grammar is None are left alone."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    xgr = backend.xgr
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], backend.vocab_size)  # (S, ceil(V/32)) int32
    for i in rows:
        grammars[i].matcher.fill_next_token_bitmask(bitmask, i)  # type: ignore[union-attr]
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=backend.vocab_size, indices=rows)
