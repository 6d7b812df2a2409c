"""Continuous batching with chunked prefill and recompute preemption.

Each step the scheduler picks, under a token budget (``max_num_batched_tokens``):

1. decodes: every running request whose prompt is done schedules one token
   (oldest first), so generation never stalls behind long prompts;
2. prefills: running requests whose prompt is being chunked, then waiting
   requests in arrival order (a prompt longer than what is left of the budget
   gets a chunk of it, unless the rest is within an eighth of the budget: a
   prompt's last chunk may overrun it by that much, so that a small tail does
   not hold its first token back a whole step; batch_builder.py), while fewer
   than ``max_num_seqs`` requests run.

A request's ``priority`` (vLLM's: lower is served earlier; 0 by default) orders
the queue: a request waits behind those of its priority or a lower value, in
arrival order, and a preempted one returns in front of its priority. Among
running requests the one preempted is the newest of the highest value. With
every priority equal this is arrival order throughout. Outputs never depend on
it: a token's arithmetic depends only on its own request.

When the KV cache is full, the NEWEST running request is preempted: its blocks
are freed, its computed count is reset, and it goes back to the front of the
queue; later it recomputes its prompt and the tokens generated so far. The
oldest request always makes progress, so the engine never livelocks, and a
preempted request's output is the same as if it had never been preempted (its
sampled tokens are kept and its RNG is never rewound).

Sliding windows: where every layer of the model has one, the blocks of a
running request that no later step can read go back to the pool before each
step is planned (BlockManager.free_unread), so admission and preemption count
only the blocks requests still hold.

Prefix caching: a request is admitted with the longest run of its leading
full blocks found in the cache as already computed (num_computed_tokens > 0),
always leaving its last known token to compute, so that it samples. A request
preempted and recomputed looks up its prompt and outputs the same way.

After the step, ``update_from_output`` records what it gave: the sampled
tokens, the tokens now in the KV cache, each verify row's accepted drafts
(the rejected drafts' blocks go back), the finished requests, and the samples
of a prompt held until its first sample computed it.

The scheduler knows nothing of PCP, ranks or tensors: its output is a StepPlan.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable

from ctxpar.engine.batch_builder import BatchBuilder
from ctxpar.engine.block_manager import BlockManager, PrefixCacheStats
from ctxpar.engine.prefix_cache import cache_computed, cached_prefix
from ctxpar.engine.request import Request, RequestGroup, RequestStatus
from ctxpar.engine.sample.rejection import Verified
from ctxpar.engine.sample.step_sampler import SampledStep
from ctxpar.engine.scheduled_batch import ScheduledBatch
from ctxpar.outputs import LogprobsOnePosition

# Told of each token a step adds to a request, in order, with its logprobs where wanted;
# says whether the token finishes the request (the engine's OutputProcessor.add_token).
TokenSink = Callable[[Request, LogprobsOnePosition | None], bool]


class Scheduler:
    """Decides which requests compute which tokens in each step."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by (priority, arrival_index): running[-1] is preempted first
        self.num_preemptions = 0  # total so far, for tests and metrics
        self.prefix_cache_stats = PrefixCacheStats()

    def add(self, request: Request) -> None:
        """Queue a request; it is admitted at the next step that has room."""
        request.status = RequestStatus.WAITING
        # Behind every request of its priority or a lower value (all equal: at the end).
        self.waiting.insert(bisect.bisect_right(self.waiting, request.priority, key=_priority), request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request) -> None:
        """Remove a finished (or aborted) request and free its KV blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING and request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self._release(request)

    # -- scheduling ---------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        """Plan the next step, or None if there is nothing to run.

        Admits, preempts and allocates blocks, which leaves every request in a
        valid state whether or not the step then runs; ``num_computed_tokens``
        moves only in ``commit``, once the step has succeeded.
        """
        for req in self.running:
            cache_computed(self.block_manager, req)
            # Offered first, so a block the window gives back stays a prefix hit until evicted.
            self.block_manager.free_unread(req.request_id, req.num_computed_tokens)
        step = BatchBuilder(self.max_num_batched_tokens)
        self._schedule_decodes(step)
        self._schedule_prompt_chunks(step)
        if not step.preempted:  # the blocks just freed are for the requests already running
            self._admit_waiting(step)
        return step.build(self.block_manager)

    def _schedule_decodes(self, step: BatchBuilder) -> None:
        """1. Every running request whose prompt is done, oldest first: its next token, and
        the drafts that fit."""
        for req in list(self.running):
            if step.budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING or not req.is_decode_ready:
                continue
            if self._make_room(req, req.num_tokens, step, may_preempt_self=True):
                step.add(req, 1 + self._allocate_with_drafts(req, step.budget - 1))

    def _allocate_with_drafts(self, req: Request, budget: int) -> int:
        """Allocate a decode's blocks and those of the drafts that ride along; returns how
        many do. Drafts ride along only where the budget and free blocks allow (never a
        preemption for them), and no further than the tokens the request may still generate."""
        bm = self.block_manager
        k = min(len(req.spec_token_ids), budget, req.max_total_tokens - req.num_tokens - 1)
        if k and not bm.can_allocate(req.request_id, req.num_tokens + k):
            k = 0
        del req.spec_token_ids[k:]
        bm.truncate(req.request_id, max(req.num_tokens + k, req.num_computed_tokens))  # blocks reserved for cut drafts
        bm.allocate(req.request_id, req.num_tokens + k)
        return k

    def _schedule_prompt_chunks(self, step: BatchBuilder) -> None:
        """2. Running requests in the middle of a prompt (or of a recompute): a chunk each."""
        bm = self.block_manager
        for req in list(self.running):
            if step.budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING or step.has(req) or req.is_decode_ready:
                continue
            c = req.num_computed_tokens
            # Shrink the chunk to what fits before preempting anyone: a chunk
            # of any size makes progress.
            if not self._make_room(req, c + 1, step, may_preempt_self=False):
                continue
            q = min(step.chunk(req.num_tokens - c), bm.max_coverable_tokens(req.request_id) - c)
            bm.allocate(req.request_id, c + q)
            step.add(req, q)

    def _admit_waiting(self, step: BatchBuilder) -> None:
        """3. Waiting requests in arrival order, each from its cached prefix on, while the
        budget, ``max_num_seqs`` and the free blocks allow."""
        bm = self.block_manager
        while self.waiting and step.budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            cached = cached_prefix(bm, req)
            c = len(cached) * bm.block_size
            q = step.chunk(req.num_tokens - c)
            if not bm.can_allocate(req.request_id, c + q, cached):
                break  # first come, first served: nobody overtakes the head
            self.waiting.popleft()
            bm.allocate(req.request_id, c + q, cached)
            self._start(req, c)
            step.add(req, q)

    def _start(self, req: Request, num_cached_tokens: int) -> None:
        """A waiting request runs, its first ``num_cached_tokens`` found in the prefix cache."""
        req.num_computed_tokens = num_cached_tokens
        if self.block_manager.enable_caching:
            self.prefix_cache_stats.queries += req.num_tokens
            self.prefix_cache_stats.hits += num_cached_tokens
        if req.num_cached_tokens is None:
            req.num_cached_tokens = num_cached_tokens
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=lambda r: (r.priority, r.arrival_index))

    # -- after the step -------------------------------------------------------

    def commit(self, batch: ScheduledBatch) -> None:
        """Record that ``batch`` ran: its tokens are now in the KV cache.

        Called only after the step's execute and sampling both succeeded, so a
        failed step leaves every request's count as it was and its tokens are
        simply scheduled again. (Blocks allocated for a failed step stay with
        their request, which will fill them when it runs; preempted requests
        stay queued. Both are states a successful step can leave too.)
        """
        for req, q in zip(batch.requests, batch.plan.num_scheduled_tokens.tolist()):
            if not req.spec_token_ids:  # a verify row commits its accepted tokens only: see rollback
                req.num_computed_tokens += q

    def update_from_output(
        self, batch: ScheduledBatch, sampled: SampledStep, add_token: TokenSink
    ) -> list[RequestGroup]:
        """Record that ``batch`` ran and what its logits gave (vLLM's update_from_output); returns
        the groups that got a token, each once, in order (verify rows' first).

        Each sampled token is appended before the commit: an interruption in between still
        leaves a valid request (a known token not yet cached is recomputed). A grammar accepts
        its token only after the commit, so a failed step advances no matcher.
        """
        for req, token in zip(sampled.sampling, sampled.token_ids):
            req.output_token_ids.append(token)
        self.commit(batch)
        for req, token in zip(sampled.sampling, sampled.token_ids):
            if req.grammar is not None:
                req.grammar.accept(token)
        advanced: dict[str, RequestGroup] = {}
        for verified in sampled.verified:
            self._accept(verified, add_token)
            group = _group(verified.request)
            advanced[group.request_id] = group
        for req, lp in zip(sampled.sampling, sampled.logprobs):
            if add_token(req, lp):
                self.finish(req)
            group = _group(req)
            if req.index == 0 and group.held:
                for held in group.held:  # the prompt is computed: the other samples may share it
                    self.add(held)
                group.held = []
            advanced[group.request_id] = group
        return list(advanced.values())

    def _accept(self, verified: Verified, add_token: TokenSink) -> None:
        """Append a verify row's tokens one by one, as if each had been sampled in a step of
        its own (a stop condition drops the rest), then discard the rejected drafts' KV."""
        req = verified.request
        for token, lp in zip(verified.token_ids, verified.logprobs):
            req.output_token_ids.append(token)
            req.num_computed_tokens = req.num_tokens - 1  # the tokens before this one are cached
            if add_token(req, lp):
                self.finish(req)
            if req.finished:  # its blocks are freed already
                req.spec_token_ids = []
                return
        self.rollback(req)

    def reserve(self, req: Request, num_tokens: int) -> list[int] | None:
        """Grow a running request's blocks to cover ``num_tokens`` before the step is
        scheduled (a draft model writes its drafts' KV there first); its block table,
        or None, changing nothing, when the free blocks do not allow it (no preemption)."""
        if not self.block_manager.can_allocate(req.request_id, num_tokens):
            return None
        return self.block_manager.allocate(req.request_id, num_tokens)

    def rollback(self, req: Request) -> None:
        """After a verify row: keep the KV of the known tokens, discard the rest.

        The accepted tokens are appended (_accept); everything but the last one is
        in the cache. Blocks past them (rejected drafts' KV) go back to the pool, so
        the request holds what it would without speculation.
        """
        req.spec_token_ids = []
        req.num_computed_tokens = req.num_tokens - 1
        self.block_manager.truncate(req.request_id, req.num_computed_tokens)

    # -- preemption -----------------------------------------------------------

    def _make_room(self, req: Request, num_tokens: int, step: BatchBuilder, may_preempt_self: bool) -> bool:
        """Preempt the newest running requests not yet scheduled this step
        until ``req`` can cover ``num_tokens``. Returns False if ``req`` cannot
        run this step (it was itself the newest and got preempted, or nobody
        newer is left to preempt)."""
        bm = self.block_manager
        while not bm.can_allocate(req.request_id, num_tokens):
            victim = next((r for r in reversed(self.running) if not step.has(r)), None)
            if victim is None or (victim is req and not may_preempt_self):
                return False
            self._preempt(victim)
            step.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _release(self, req: Request) -> None:
        """Free the request's blocks; its computed full blocks stay cached."""
        cache_computed(self.block_manager, req)
        self.block_manager.free(req.request_id)

    def preempt_all(self) -> list[Request]:
        """Preempt every running request (its KV is to be recomputed); returns them."""
        held = list(self.running)
        for req in reversed(held):  # newest first: the oldest ends up in front of the queue
            self._preempt(req)
        return held

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        # Front of its priority in the queue (all equal: the front); preempting newest-first
        # leaves the oldest in front.
        self.waiting.insert(bisect.bisect_left(self.waiting, req.priority, key=_priority), req)


def _priority(req: Request) -> int:
    return req.priority


def _group(req: Request) -> RequestGroup:
    assert req.group is not None  # the engine puts each request in a group
    return req.group
