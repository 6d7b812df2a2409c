"""How the server's limits on what clients may ask of it (server_limits.py) are
enforced: the admission gate of the concurrency and queue limits, the budget of
body bytes, the checks of one request's fan-out and logprobs.

A generation request holds one of ``limit_concurrency`` slots from the moment
it is handed to the engine until its response is sent; beyond those, up to
``max_queued_requests`` wait (first come, first served) for a slot, and any
more are refused at once with a 503 and a Retry-After header, so that an
overload is a fast, explicit answer rather than an ever longer queue.

Bodies are bounded one by one (``max_body_size``) and together: the bytes of
all bodies being received or served at once stay within
``max_body_bytes_in_flight`` (BodyBudget), beyond which a request is refused
with a 503 before more of its body is read. One request is bounded in what
it asks of the engine: prompts (``max_prompts_per_request``) and sequences,
prompts x n (``max_sequences_per_request``): otherwise a single admission
slot could carry thousands of generations. And in what its answer may hold:
logprobs, of the prompt's tokens and of the tokens generated, at most
``max_logprob_entries`` (a 128K-token prompt with prompt_logprobs=20 would be
2.7 M entries, hundreds of MB of JSON).

Connections are bounded before they carry a request (connections.py): a
request's head within ``timeout_header`` s, at most ``max_connections`` open.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from ctxpar.entrypoints.openai.protocol import ApiError
from ctxpar.entrypoints.openai.server_limits import ServerLimits
from ctxpar.sampling_params import ALL_LOGPROBS

if TYPE_CHECKING:  # torch's import is not worth `ctxpar serve --help`
    from ctxpar.engine.input_processor import EngineRequest

# What a refused client is told to wait: slots free as requests finish, which
# at the server's usual pace is well within a second or two.
RETRY_AFTER_S = 1


def overloaded(limits: ServerLimits) -> ApiError:
    return ApiError(
        503,
        f"the server is at its limit ({limits.limit_concurrency} requests running and "
        f"{limits.max_queued_requests} queued): retry after {RETRY_AFTER_S} s",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


class Admission:
    """Slots for generation requests, with a bounded queue (event loop only)."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self._slots = asyncio.Semaphore(limits.limit_concurrency)
        self.queued = 0  # waiting for a slot
        self.running = 0  # holding one

    def full(self) -> bool:
        """No free slot and no room in the queue: a new request would be refused."""
        return self._slots.locked() and self.queued >= self.limits.max_queued_requests

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a slot for the block, after waiting in the queue for one (the
        caller has checked ``full()``: a full queue is refused, not joined)."""
        self.queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.queued -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()


def check_fanout(limits: ServerLimits, prompts: int, n: int, best_of: int | None = None) -> None:
    """A 400 naming the limit and its flag if a request of ``prompts`` prompts, each
    sampled max(n, best_of) times, asks for more than one request may."""
    if prompts > limits.max_prompts_per_request:
        raise ApiError(
            400,
            f"{prompts} prompts in one request: the server takes at most {limits.max_prompts_per_request} "
            "(--max-prompts-per-request); send them in several requests",
            param="prompt",
        )
    field, samples = ("best_of", best_of) if best_of is not None and best_of > n else ("n", n)
    if prompts * samples > limits.max_sequences_per_request:
        raise ApiError(
            400,
            f"{prompts} prompt(s) x {field}={samples} = {prompts * samples} sequences in one request: the server "
            f"takes at most {limits.max_sequences_per_request} (--max-sequences-per-request)",
            param=field,
        )


def check_logprobs(limits: ServerLimits, requests: list[EngineRequest], vocab_size: int) -> None:
    """A 400 naming the limit and its flag if the logprobs the requests' answer would carry,
    (prompt_logprobs + 1) per prompt token and (logprobs + 1) per generated token of each
    sequence up to max_tokens, pass ``max_logprob_entries``."""
    entries = 0
    for r in requests:
        p = r.params
        per_prompt = vocab_size if p.prompt_logprobs == ALL_LOGPROBS else p.prompt_logprobs
        per_token = vocab_size if p.logprobs == ALL_LOGPROBS else p.logprobs
        if per_prompt is not None:
            entries += len(r.prompt_token_ids) * (per_prompt + 1)
        if per_token is not None:
            entries += p.num_samples * (p.max_tokens or 0) * (per_token + 1)
    if entries > limits.max_logprob_entries:
        raise ApiError(
            400,
            f"this request's answer would carry {entries} logprobs (prompt tokens x (prompt_logprobs + 1) + sequences "
            f"x max_tokens x (logprobs + 1)): the server sends at most {limits.max_logprob_entries} in one answer "
            "(--max-logprob-entries); ask for fewer, or for a shorter prompt's",
            param="prompt_logprobs",
        )


class BodyBudget:
    """The bytes of request bodies held at once, within ``max_body_bytes_in_flight``
    (event loop only). A request holds what it has received until its response is
    sent: its body, and what the route made of it, live that long."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limit = limits.max_body_bytes_in_flight
        self.held = 0

    def take(self, nbytes: int) -> None:
        """Hold ``nbytes`` more; a 503 (nothing held) if that would pass the limit."""
        if self.held + nbytes > self.limit:
            raise ApiError(
                503,
                f"the server is receiving or serving {self.held} bytes of request bodies, and this one would pass its "
                f"limit of {self.limit} (--max-body-bytes-in-flight): retry after {RETRY_AFTER_S} s",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.held += nbytes

    def give_back(self, nbytes: int) -> None:
        self.held -= nbytes
