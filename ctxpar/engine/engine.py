"""The engine loop on rank 0: requests in, tokens out.

``Engine`` holds one component per stage, each in its own module:

- intake: ``InputProcessor`` checks every request once and makes its samples;
- ``Scheduler``: which requests compute which tokens (a StepPlan), and,
  after the step, what it changed (``update_from_output``);
- execution: the executor runs the plan on every rank, through
  ``RankLossHandler``, which recovers from lost ranks;
- ``StepSampler``: the logits become tokens (masks, verification, sampling)
  with the requests' RNG states restored if the step fails;
- ``OutputProcessor``: text, logprobs, stop conditions and RequestOutputs;
- ``SpecDecoder`` (speculative decoding) drafts before the step is scheduled.

``step()`` is those stages in order: schedule, execute, sample, update from
the output.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

from ctxpar.config import EngineConfig
from ctxpar.engine.block_manager import BlockManager
from ctxpar.engine.input_processor import EngineRequest, InputProcessor
from ctxpar.engine.kv_window import freeing_window
from ctxpar.engine.output_processor import OutputProcessor, make_output
from ctxpar.engine.rank_loss import CacheRebuilt, RankLossHandler, block_manager_for
from ctxpar.engine.rank_recovery import RankRecovery
from ctxpar.engine.request import Request, RequestGroup, RequestStatus
from ctxpar.engine.sample.step_sampler import SampledStep, StepSampler
from ctxpar.engine.sample.structured_output import StructuredOutputs
from ctxpar.engine.scheduled_batch import ScheduledBatch
from ctxpar.engine.scheduler import Scheduler
from ctxpar.engine.spec_decode import SpecDecoder
from ctxpar.errors import CtxparError
from ctxpar.executor import start_executor
from ctxpar.outputs import RequestOutput
from ctxpar.sampling_params import SamplingParams
from ctxpar.worker.step_plan import StepOutput

logger = logging.getLogger("ctxpar")


class Engine:
    """Continuous-batching inference engine for one model."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = start_executor(config)  # every rank loads its model and sizes its KV cache
        rank_model = self.executor.rank_model
        self.loaded = rank_model.loaded
        self.vocab_size: int = int(self.loaded.hf_config.vocab_size)
        self.kv_bytes_per_token_per_layer = rank_model.kv_bytes_per_token_per_layer
        self.num_blocks = rank_model.num_blocks
        self.requests: dict[str, Request] = {}  # by sample id (the request id when n == 1)
        self.groups: dict[str, RequestGroup] = {}  # by request id: what the caller added
        self._arrivals = itertools.count()
        self.num_steps = 0
        tokenizer = self.loaded.tokenizer
        # Detokenizing, logprobs' text, stop conditions and outputs (it holds the EOS ids).
        self.output_processor = OutputProcessor(tokenizer, set(self.loaded.eos_token_ids))
        window = freeing_window(self.loaded.hf_config, rank_model.draft is not None)
        block_manager = block_manager_for(config, self.num_blocks, config.dcp_size, window)
        self.scheduler = Scheduler(block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.rank_loss = RankLossHandler(config, self.executor, self.scheduler, self.groups)
        self.structured = StructuredOutputs(tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        # The processor's callables hold the engine's parts, never the engine: a reference
        # back to it would be a cycle, and a closed engine's weights and KV cache would
        # then wait for the cycle collector instead of going at once.
        self.processor = InputProcessor(
            tokenizer,
            self.vocab_size,
            config.max_logprobs,
            config.seed,
            partial(_context_limit, self.loaded.max_model_len, self.scheduler),
            self.structured.compile,
        )
        self.spec: SpecDecoder | None = None
        if config.speculative_config is not None:
            draft = rank_model.draft  # a draft model or the mtp layer; None for n-gram drafts
            self.spec = SpecDecoder.create(
                config.speculative_config,
                draft.max_model_len if draft is not None else None,
                self.max_model_len,
                self.rank_loss.execute,  # the proposer's steps recover from lost ranks too
                self.scheduler.reserve,
            )
        self.sampler = StepSampler(self.structured, self.spec.draft_probs if self.spec is not None else None)

    # -- what callers read ----------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        """The tokenizer prompts and outputs use (None: prompts are token ids, outputs have no text)."""
        return self.processor.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        self.processor.tokenizer = tokenizer

    @property
    def eos_token_ids(self) -> set[int]:
        """Generation stops at any of these (unless ignore_eos)."""
        return self.output_processor.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        self.output_processor.eos_token_ids = ids

    @property
    def max_model_len(self) -> int:
        """The longest context (prompt and output) a request may have: the model's, or what
        the KV cache holds where a lost DCP rank left it smaller."""
        return _context_limit(self.loaded.max_model_len, self.scheduler)

    @property
    def block_manager(self) -> BlockManager:
        """The scheduler's KV blocks (a lost DCP rank makes it a new one)."""
        return self.scheduler.block_manager

    @property
    def dcp_size(self) -> int:
        """DCP ranks the KV cache is sharded over now (fewer after a lost rank left out)."""
        return self.rank_loss.dcp_size

    @property
    def recovery(self) -> RankRecovery:
        """Lost ranks found and recovered, and whether a recovery runs now."""
        return self.rank_loss.stats

    # -- requests -----------------------------------------------------------

    def add_request(
        self,
        request: EngineRequest | Sequence[int],
        params: SamplingParams | None = None,
        prompt: str | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request (its ``n`` or ``best_of`` samples); returns its id.

        request: what ``processor`` made of it (checked already), or the prompt's token ids,
            checked here with ``params`` (None: the defaults) and ``prompt`` (its text).
        arrival_time: when it arrived (``time.perf_counter()``; default now)."""
        if not isinstance(request, EngineRequest):
            request = self.processor.process_tokens(request, params, prompt)
        grammar = request.grammar  # compiled by the processor, off this thread
        index = next(self._arrivals)
        request_id = request_id if request_id is not None else str(index)
        arrival = arrival_time if arrival_time is not None else time.perf_counter()
        group = self.processor.make_group(request, request_id, index, arrival, grammar, sorted(self.eos_token_ids))
        if request_id in self.groups or any(r.request_id in self.requests for r in group.samples):
            raise CtxparError(f"request id {request_id!r} is already in use")
        self.groups[request_id] = group
        self.requests.update((r.request_id, r) for r in group.samples)
        if grammar is not None:
            self.structured.compiling.append(group)  # scheduled once its grammar is compiled
        else:
            self.scheduler.add(group.samples[0])
        return request_id

    def abort(self, request_id: str) -> None:
        """Drop a request and all its samples (e.g. a stream the caller stopped reading)."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        if group in self.structured.compiling:
            self.structured.compiling.remove(group)
        for req in group.samples:
            self.requests.pop(req.request_id, None)
            if req in group.held:
                req.status = RequestStatus.FINISHED  # never reached the scheduler
            elif not req.finished:
                req.finish_reason = "abort"
                self.scheduler.finish(req)
        group.held = []

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.is_compiling_grammars()

    def is_compiling_grammars(self) -> bool:
        """Requests wait for their grammar (a step may then run nothing, briefly)."""
        return bool(self.structured.compiling)

    def check_health(self) -> None:
        """RankFailure if a rank is lost and cannot be recovered (vLLM's check_health); one
        found lost while the engine is idle is recovered here, before a request needs it."""
        self.rank_loss.check_health()

    # -- the loop -----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the requests that got a new token (finished
        ones included, each for the last time: the engine then forgets them).
        A best_of request (best_of > n) is returned once, finished.

        A step is all or nothing. If drafting, running or sampling raises (any
        exception, KeyboardInterrupt included), no request has advanced: each
        keeps its computed-token count, its tokens and its RNG state, so the
        step is simply scheduled again. The exception goes to the caller.
        """
        outputs = self._admit_compiled() + self._fail_unfit()
        try:
            with self.sampler.restoring_rng(self.scheduler.running) as rng:
                batch = self._schedule()
                if batch is None:
                    return outputs
                rng.save(batch.requests)  # those admitted just now sample too
                run = self.rank_loss.execute(batch.plan)
                sampled = self.sampler.sample(batch.requests, batch.plan, run.logits)
        except CacheRebuilt:  # a lost rank's recovery preempted every request: nothing ran
            return outputs + self._fail_unfit()
        return outputs + self._update_from_output(batch, run, sampled)

    def _schedule(self) -> ScheduledBatch | None:
        """Drafts for the requests about to decode, then the step's batch."""
        if self.spec is None:
            return self.scheduler.schedule()
        self.spec.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if batch is not None:  # the mtp layer is fed the target's hidden states
            batch.plan = self.spec.with_hidden_rows(batch.plan, batch.requests)
        return batch

    def _update_from_output(self, batch: ScheduledBatch, run: StepOutput, sampled: SampledStep) -> list[RequestOutput]:
        """Commit a step that ran and sampled; the outputs of the requests it advanced."""
        self.num_steps += 1
        if self.spec is not None:
            self.spec.record(sampled.verified)
            if run.hidden is not None:  # only the mtp layer asks for hidden states
                self.spec.keep_hidden(batch.requests, batch.plan, run.hidden)
        self.output_processor.add_prompt_logprobs(sampled.prompt_chunks)
        add_token = partial(self.output_processor.add_token, now=time.perf_counter())
        advanced = self.scheduler.update_from_output(batch, sampled, add_token)
        outputs = self.output_processor.make_outputs(advanced)
        for group in advanced:
            if group.finished:
                self._forget(group)
        return outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar is now compiled; a grammar that failed
        to compile finishes its request alone ("abort"), as vLLM does."""
        failed = []
        for group, error in self.structured.take_ready(block=not self.scheduler.has_unfinished()):
            if error is None:
                self.scheduler.add(group.samples[0])
                continue
            failed.append(self._fail_alone(group, f"its grammar failed to compile: {error}"))
        return failed

    def _fail_unfit(self) -> list[RequestOutput]:
        """Fail alone the requests a rebuilt KV cache no longer fits (RankLossHandler); their outputs."""
        return [self._fail_alone(group, why) for group, why in self.rank_loss.take_unfit()]

    def _fail_alone(self, group: RequestGroup, why: str) -> RequestOutput:
        """Finish a request that cannot go on ("abort"), leaving the others be; its last output."""
        logger.error("request %s: %s", group.request_id, why)
        for req in group.samples:
            if req in self.scheduler.waiting:
                self.scheduler.waiting.remove(req)
            req.status, req.finish_reason = RequestStatus.FINISHED, "abort"
        group.held = []
        output = make_output(group)
        self._forget(group)
        return output

    def _forget(self, group: RequestGroup) -> None:
        """Drop a finished group: its last output has been made."""
        del self.groups[group.request_id]
        for req in group.samples:
            del self.requests[req.request_id]

    def close(self) -> None:
        """Release the executor (and the worker ranks, if any)."""
        self.structured.close()
        if self.executor is not None:
            self.executor.close()
            self.executor = None  # type: ignore[assignment]


def _context_limit(model_len: int, scheduler: Scheduler) -> int:
    """The model's context, or what the scheduler's KV blocks hold where fewer."""
    bm = scheduler.block_manager
    return min(model_len, bm.num_blocks * bm.block_size)
