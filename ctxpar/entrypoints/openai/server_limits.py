"""ServerLimits: ``ctxpar serve``'s client limits, each written once as a knob (ctxpar/knobs.py):
its default, its flag's help and its range. serve's "client limits" flags are made from
these fields, and ``ServerLimits(...)`` checks every range, so a limit has one
definition. What each limit bounds and why: limits.py, connections.py, guard.py.

The module imports no torch, so that `ctxpar serve --help` shows the defaults at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ctxpar.engine.sample.grammar_cache import (
    DEFAULT_CACHE_BYTES,
    DEFAULT_COMPILE_TIMEOUT_S,
    DEFAULT_MAX_SPEC_BYTES,
    DEFAULT_WORKER_MEMORY,
)
from ctxpar.errors import CtxparError
from ctxpar.knobs import Range, check_knobs, knob

AT_LEAST_ONE = Range(1)
SECONDS = Range(0, lo_open=True, why=" (seconds)")


@dataclass(frozen=True)
class ServerLimits:
    """``ctxpar serve``'s client limits (its flags of the same names)."""

    limit_concurrency: int = knob(
        256, "generation requests in the engine at once; more wait in the queue", "N", range=AT_LEAST_ONE
    )
    max_queued_requests: int = knob(
        256, "generation requests waiting for a slot; beyond, 503 with Retry-After", "N", range=Range(0)
    )
    max_body_size: int = knob(
        16 << 20, "largest request body (default: 16 MiB); larger: 413", "BYTES", range=AT_LEAST_ONE
    )
    timeout_client: int = knob(
        30,
        "seconds a client has to send its whole body (else 408), and a response waits for a client that "
        "reads none of it before the request is dropped",
        "S",
        range=AT_LEAST_ONE,
    )
    timeout_graceful_shutdown: int = knob(
        10, "after SIGINT/SIGTERM, seconds requests in flight get to finish", "S", range=Range(0)
    )
    max_body_bytes_in_flight: int = knob(
        256 << 20,
        "bytes of all request bodies being received or served at once (default: 256 MiB; at least "
        "--max-body-size); beyond, 503 with Retry-After",
        "BYTES",
        range=AT_LEAST_ONE,
    )
    max_prompts_per_request: int = knob(
        256, "prompts in one /v1/completions request; more: 400", "N", range=AT_LEAST_ONE
    )
    max_sequences_per_request: int = knob(
        1024,
        "prompts x max(n, best_of) of one request; more: 400. One request holds one --limit-concurrency slot "
        "however many sequences it asks for",
        "N",
        range=AT_LEAST_ONE,
    )
    grammar_cache_bytes: int = knob(
        DEFAULT_CACHE_BYTES,
        "compiled grammars of structured outputs kept for reuse, by xgrammar's size of each plus its schema "
        f"(default: {DEFAULT_CACHE_BYTES >> 20} MiB); the least recently used go first",
        "BYTES",
        range=AT_LEAST_ONE,
    )
    grammar_compile_timeout: float = knob(
        DEFAULT_COMPILE_TIMEOUT_S,
        "seconds a schema, regex or grammar may take to compile; longer: 408, and the compiler's process is killed",
        "S",
        range=SECONDS,
    )
    max_grammar_bytes: int = knob(
        DEFAULT_MAX_SPEC_BYTES,
        "characters of one schema, regex, grammar or choice list; more: 400",
        "N",
        range=AT_LEAST_ONE,
    )
    grammar_memory_bytes: int = knob(
        DEFAULT_WORKER_MEMORY,
        f"address space of the process that compiles grammars (default: {DEFAULT_WORKER_MEMORY >> 30} GiB); "
        "a spec that needs more: 400",
        "BYTES",
        range=AT_LEAST_ONE,
    )
    timeout_header: float = knob(
        10.0,
        "seconds a connection has to send a request's line and headers; later: 408 and the connection is closed",
        "S",
        range=SECONDS,
    )
    max_connections: int = knob(1024, "connections open at once; more are closed as they come", "N", range=AT_LEAST_ONE)
    max_logprob_entries: int = knob(
        1 << 22,
        "logprobs one answer may carry: prompt tokens x (prompt_logprobs + 1) + sequences x max_tokens x "
        "(logprobs + 1); more: 400",
        "N",
        range=AT_LEAST_ONE,
    )

    def __post_init__(self) -> None:
        check_knobs(self)
        if self.max_body_bytes_in_flight < self.max_body_size:
            raise CtxparError(
                f"--max-body-bytes-in-flight ({self.max_body_bytes_in_flight}) must be at least "
                f"--max-body-size ({self.max_body_size}): a body of the largest size could never be received"
            )
        if self.max_sequences_per_request < self.max_prompts_per_request:
            raise CtxparError(
                f"--max-sequences-per-request ({self.max_sequences_per_request}) must be at least "
                f"--max-prompts-per-request ({self.max_prompts_per_request}): each prompt is one sequence or more"
            )
