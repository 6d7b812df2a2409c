"""The compiled-grammar cache: least recently used first out, within a byte bound.

Its keys come from clients (a JSON schema, a regex, an EBNF grammar), so an
unbounded cache lets anyone grow the server's memory one distinct schema at a
time (the class of xgrammar's advisory GHSA-389x-67px-mjg3; vLLM bounds its
cache at 512 MB). An entry costs what xgrammar reports for its compiled grammar
(``memory_size_bytes``) plus its key, which holds the client's whole schema; a
compile still in progress is charged for its key alone until it finishes.

The engine thread and the server's event loop (which waits for a request's
grammar before handing the request over) both use it: every method takes the lock.
The module imports no torch, so that `ctxpar serve --help` can show its defaults.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

# vLLM's bound (VLLM_XGRAMMAR_CACHE_MB); a compiled grammar of a typical schema is
# tens of KB to a few MB with a 50K-150K token vocabulary.
DEFAULT_CACHE_BYTES = 512 << 20
# Seconds a request waits for its grammar. A client's schema can take a compile
# arbitrarily long; past this its request fails and the compiler's process is
# killed (grammar_worker.py: xgrammar cannot interrupt a compile otherwise).
DEFAULT_COMPILE_TIMEOUT_S = 30.0
# Characters of one spec (its key's text). Real schemas are a few KB; a 7.6 MB
# nested allOf took 20 s and 800 MB to parse.
DEFAULT_MAX_SPEC_BYTES = 256 << 10
# The compiler process's address space: xgrammar and torch mapped (~1 GiB of it
# untouched), a parse or compile that wants more fails in that process alone.
DEFAULT_WORKER_MEMORY = 4 << 30


def key_bytes(key: tuple) -> int:
    """What a key holds, roughly: the length of its parts' text."""
    return sum(len(part) if isinstance(part, str) else 8 for part in key)


class GrammarCache:
    """key -> Future of a compiled grammar, evicting the least recently used
    finished entries once their bytes pass ``max_bytes``."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"the grammar cache needs a positive bound, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple, Future] = OrderedDict()
        self._sizes: dict[tuple, int] = {}
        self._pending: set[tuple] = set()  # compiling: charged for the key until done
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple) -> Future | None:
        """The cached Future of ``key``, now the most recently used; None if there is none."""
        with self._lock:
            return self._touch(key)

    def get_or_compile(self, key: tuple, compile: Callable[[], Future]) -> Future:
        """The cached Future of ``key`` (now the most recently used), else ``compile()``'s, cached."""
        with self._lock:
            self._settle()
            fut = self._touch(key)
            if fut is not None:
                return fut
            fut = compile()
            self._entries[key] = fut
            self._sizes[key] = key_bytes(key)
            self._bytes += self._sizes[key]
            self._pending.add(key)
            self._evict()
            return fut

    def discard(self, key: tuple, fut: Future) -> None:
        """Forget ``key`` if it still maps to ``fut`` (a compile given up on)."""
        with self._lock:
            if self._entries.get(key) is fut:
                self._drop(key)

    @property
    def nbytes(self) -> int:
        """Bytes charged to the entries (finished compiles counted at their size)."""
        with self._lock:
            self._settle()
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __iter__(self) -> Iterator[tuple]:
        with self._lock:
            return iter(list(self._entries))

    def _touch(self, key: tuple) -> Future | None:
        fut = self._entries.get(key)
        if fut is not None and fut.cancelled():
            self._drop(key)  # given up on: a new request compiles it anew
            return None
        if fut is not None:
            self._entries.move_to_end(key)
        return fut

    def _settle(self) -> None:
        """Charge the compiles that finished since the last call at their real size."""
        for key in [k for k in self._pending if self._entries[k].done()]:
            self._pending.discard(key)
            fut = self._entries[key]
            if fut.cancelled() or fut.exception() is not None:
                self._drop(key)  # a failure is not worth keeping: the request that asked is told
                continue
            size = key_bytes(key) + _compiled_bytes(fut.result())
            self._bytes += size - self._sizes[key]
            self._sizes[key] = size
        self._evict()

    def _evict(self) -> None:
        # Oldest first; an entry still compiling stays (requests wait on it, and it is
        # charged only for its key), so the bound holds once compiles finish.
        for key in list(self._entries):
            if self._bytes <= self.max_bytes:
                return
            if key not in self._pending:
                self._drop(key)

    def _drop(self, key: tuple) -> None:
        del self._entries[key]
        self._bytes -= self._sizes.pop(key)
        self._pending.discard(key)


def _compiled_bytes(compiled: Any) -> int:
    return int(getattr(compiled, "memory_size_bytes", 0))
