"""The engine loop on rank 0: requests in, tokens out.

``Engine`` owns the tokenizer, the scheduler and its block manager, the
executor (which runs the model on one or more ranks) and the sampler. Each
``step()`` schedules a StepPlan, runs it, samples the rows that reached the
end of their known tokens, checks stop conditions and detokenizes.

Every request is validated in full before it is queued, so a bad request
raises a CtxparError and leaves the requests already in flight untouched.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from ctxpar.config import EngineConfig
from ctxpar.engine.detokenizer import IncrementalDetokenizer
from ctxpar.engine.output_processor import OutputProcessor, make_output
from ctxpar.engine.rank_loss import CacheRebuilt, RankLoss
from ctxpar.engine.recovery import RankRecovery
from ctxpar.engine.request import Request, RequestGroup, RequestStatus
from ctxpar.engine.sample.grammar import RequestGrammar
from ctxpar.engine.sample.prompt_logprobs import new_entries, split_logits, wants_prompt_logits
from ctxpar.engine.sample.sampler import Sampler
from ctxpar.engine.sample.structured_output import StructuredOutputs
from ctxpar.engine.scheduler import Scheduler
from ctxpar.engine.spec_decode import SpecDecoder, Verified
from ctxpar.engine.spec_decode.draft import DraftModelProposer
from ctxpar.engine.spec_decode.mtp import MTPProposer
from ctxpar.engine.validation import check_request
from ctxpar.errors import CtxparError
from ctxpar.executor import start_executor
from ctxpar.outputs import RequestMetrics, RequestOutput
from ctxpar.sampling_params import SEED_MAX, SamplingParams

logger = logging.getLogger("ctxpar")


class Engine(RankLoss):
    """Continuous-batching inference engine for one model."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = start_executor(config)  # every rank loads its model and sizes its KV cache
        rank_model = self.executor.rank_model
        self.loaded = rank_model.loaded
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len: int = self.loaded.max_model_len
        self.vocab_size: int = int(self.loaded.hf_config.vocab_size)
        # Detokenizing, logprobs' text, stop conditions and outputs (it holds the EOS ids).
        self.output_processor = OutputProcessor(self.tokenizer, set(self.loaded.eos_token_ids))
        self.kv_bytes_per_token_per_layer = rank_model.kv_bytes_per_token_per_layer
        self.num_blocks = rank_model.num_blocks
        self.dcp_size = config.dcp_size  # fewer after a lost rank left out under DCP (RankLoss._go_on)
        self.block_manager = self._block_manager()
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler()
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        self.spec = self._spec_decoder(config)
        self.recovery = RankRecovery(
            config.max_rank_recoveries,
            config.rank_recovery_window_s,
            pcp_size=config.pcp_size,
            pcp_ranks=config.pcp_size,
        )
        self._unfit: list[tuple[RequestGroup, str]] | None = None  # see RankLoss
        self.requests: dict[str, Request] = {}  # by sample id (the request id when n == 1)
        self.groups: dict[str, RequestGroup] = {}  # by request id: what the caller added
        self._arrivals = itertools.count()
        self.num_steps = 0

    @property
    def eos_token_ids(self) -> set[int]:
        """Generation stops at any of these (unless ignore_eos)."""
        return self.output_processor.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        self.output_processor.eos_token_ids = ids

    def _spec_decoder(self, config: EngineConfig) -> SpecDecoder | None:
        spec = config.speculative_config
        if spec is None:
            return None
        draft = self.executor.rank_model.draft
        if draft is None:
            return SpecDecoder(spec)
        limit = min(draft.max_model_len, self.max_model_len)
        proposer = MTPProposer if spec.method == "mtp" else DraftModelProposer
        return SpecDecoder(spec, proposer(spec.num_speculative_tokens, limit, self._execute, self.scheduler.reserve))

    # -- requests -----------------------------------------------------------

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """Check a request without queuing it; returns the ids as a list of ints
        (the last ``truncate_prompt_tokens`` of them when that is set).

        Raises CtxparError naming the bad value and the limit.
        """
        return check_request(
            prompt_token_ids,
            params,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            max_logprobs=self.config.max_logprobs,
            has_tokenizer=self.tokenizer is not None,
        )

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        prompt: str | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request (its ``n`` or ``best_of`` samples); returns its id.
        arrival_time: when it arrived (``time.perf_counter()``; default now)."""
        params = params if params is not None else SamplingParams()
        ids = self.validate(prompt_token_ids, params)
        # A private copy, re-validated so every derived field follows the copied values:
        # changing the caller's object (or its lists) later cannot reach a request in flight.
        params = params.clone()
        params.validate()
        # Parsed now (a bad schema fails here, alone); compiled beside the step loop.
        so = params.structured_outputs
        compiled = self.structured.compile(so) if so is not None else None
        index = next(self._arrivals)
        request_id = request_id if request_id is not None else str(index)
        k = params.num_samples
        sample_ids = [request_id] if k == 1 else [f"{i}_{request_id}" for i in range(k)]  # vLLM's child ids
        if request_id in self.groups or any(r in self.requests for r in sample_ids):
            raise CtxparError(f"request id {request_id!r} is already in use")
        bad_words = self._bad_words_token_ids(params.bad_words or [])
        assert params.stop_token_ids is not None  # validate() made it a list
        banned = list(params.stop_token_ids) + ([] if params.ignore_eos else sorted(self.eos_token_ids))
        group = RequestGroup(request_id, prompt, ids, params, samples=[])
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        # One request to the caller: one clock.
        metrics = RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.perf_counter())
        for i, sid in enumerate(sample_ids):
            req = Request(
                request_id=sid,
                prompt_token_ids=ids,
                params=params,
                arrival_index=index,
                metrics=metrics,
                generator=self._generator(params, index, i),
                prompt=prompt,
                max_total_tokens=min(len(ids) + (params.max_tokens or self.max_model_len), self.max_model_len),
                bad_words_token_ids=bad_words,
                min_tokens_banned=banned,
                group=group,
                index=i,
                # Prompt logprobs need every prompt token's hidden state: no prefix-cache reads.
                skip_prefix_cache=i == 0 and params.prompt_logprobs is not None,
                grammar=RequestGrammar(compiled) if compiled is not None else None,
            )
            req.detokenizer = IncrementalDetokenizer(
                self.tokenizer if params.detokenize else None,
                ids,
                params.stop_strings,
                params.skip_special_tokens,
                params.spaces_between_special_tokens,
                params.include_stop_str_in_output,
                params.min_tokens,
            )
            group.samples.append(req)
            self.requests[sid] = req
        # The other samples start once the first one's prompt is in the KV cache, and share its blocks.
        group.held = group.samples[1:]
        self.groups[request_id] = group
        if compiled is not None:
            self.structured.compiling.append(group)  # scheduled once its grammar is compiled
        else:
            self.scheduler.add(group.samples[0])
        return request_id

    def _generator(self, params: SamplingParams, index: int, sample: int) -> torch.Generator | None:
        """Sample ``sample``'s own RNG: its draws never depend on the rest of the batch."""
        if params.greedy:
            return None
        seed = params.seed
        if seed is not None:
            seed += sample  # vLLM's seed of sample i; wrapped into the 64 bits manual_seed takes
            if seed > SEED_MAX:
                seed -= 1 << 64
        else:
            # Unseeded: seeded from the engine seed and the arrival index, so runs are reproducible.
            entropy = (self.config.seed, index) if sample == 0 else (self.config.seed, index, sample)
            seed = int(np.random.SeedSequence(entropy).generate_state(1)[0])
        return torch.Generator().manual_seed(seed)

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's tokens, as vLLM tokenizes them: the word alone, and after
        a space (a word mid-text) when that gives a different word token of the same length."""
        out: list[list[int]] = []
        for word in words:
            alone = list(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            out.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        return out

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

    # -- the loop -----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the requests that got a new token (finished
        ones included, each for the last time: the engine then forgets them).
        A best_of request (best_of > n) is returned once, finished.

        A step is all or nothing. If running or sampling it raises (any
        exception, KeyboardInterrupt included), no request has advanced: each
        keeps its computed-token count, its tokens and its RNG state, so the
        step is simply scheduled again. The exception goes to the caller.
        """
        outputs = self._admit_compiled() + self._take_unfit()
        # Drafts and samples draw from the requests' generators: their states are saved
        # first, so a failing step leaves every generator where it was.
        rng_states = _saved_generators(self.scheduler.running, {})
        if self.spec is not None:
            try:
                self.spec.propose(self.scheduler.running)
            except BaseException:
                _restore_generators(rng_states)
                raise
        batch = self.scheduler.schedule()
        if batch is None:
            return outputs
        now = time.perf_counter()
        for req in batch.requests:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
        plan = batch.plan
        all_logits = np.array([wants_prompt_logits(r) for r in batch.requests])
        if all_logits.any():
            verifies = plan.all_logits if plan.all_logits is not None else False  # verify rows (speculation)
            plan = batch.plan = dataclasses.replace(plan, all_logits=all_logits | verifies)
        hidden_rows = self.spec.hidden_rows(batch.requests) if self.spec is not None else None
        if hidden_rows is not None:  # the mtp layer is fed the target's hidden states
            plan = batch.plan = dataclasses.replace(plan, hidden_rows=hidden_rows)
        sampling = [r for r, need in zip(batch.requests, plan.needs_logits) if need and not r.spec_token_ids]
        verifying = [r for r in batch.requests if r.spec_token_ids]
        generators = [r.generator for r in sampling + verifying]
        rng_states = _saved_generators(sampling, rng_states)  # requests admitted just now
        try:
            step_out = self._execute(plan)
            logits = step_out.logits
            sample_rows, prompt_chunks, verify_starts = split_logits(batch.requests, plan, logits)
            sample_logits = logits if sample_rows is None else logits[sample_rows]
            self.structured.mask(sample_logits, sampling)  # before anything reads them, as vLLM
            verified: list[Verified] = []
            if verifying:
                assert self.spec is not None  # only a SpecDecoder drafts
                verified = self.spec.verify(verifying, logits, verify_starts)
            out = self.sampler(
                sample_logits,
                [r.params for r in sampling],
                generators,
                sampling,
                [r.cumulative_logprob is not None for r in sampling],
            )
        except CacheRebuilt:  # a lost rank's recovery preempted every request: nothing ran
            _restore_generators(rng_states)
            return outputs + self._take_unfit()
        except BaseException:
            _restore_generators(rng_states)
            raise
        # Success: record the tokens, then commit. In this order an interruption in
        # between still leaves a valid request (a known token not yet cached is recomputed).
        for req, token in zip(sampling, out.token_ids):
            req.output_token_ids.append(token)
        self.scheduler.commit(batch)
        if step_out.hidden is not None:
            assert self.spec is not None  # only the mtp layer asks for hidden states
            self.spec.keep_hidden(batch.requests, plan, step_out.hidden)
        self.structured.accept(sampling, out.token_ids)
        self.num_steps += 1
        for chunk in prompt_chunks:
            assert chunk.group.prompt_logprobs is not None  # the chunk's group wants prompt logprobs
            chunk.group.prompt_logprobs += [
                self.output_processor.with_text(e, chunk.group.params.detokenize) for e in new_entries(chunk)
            ]
        now = time.perf_counter()
        touched: dict[str, RequestGroup] = {}
        for req, v in zip(verifying, verified):
            self._accept(req, v, now)
            assert req.group is not None  # add_request puts each request in a group
            touched[req.group.request_id] = req.group
        for req, lp in zip(sampling, out.logprobs):
            if self.output_processor.add_token(req, lp, now):
                self.scheduler.finish(req)
            group = req.group
            assert group is not None  # add_request puts each request in a group
            if req.index == 0 and group.held:
                for held in group.held:  # the prompt is computed: the other samples may share it
                    self.scheduler.add(held)
                group.held = []
            touched[group.request_id] = group
        for group in touched.values():
            if group.params.num_samples > group.params.n and not group.finished:
                continue  # best_of: only the finished ranking means anything
            outputs.append(make_output(group))
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

    def _take_unfit(self) -> list[RequestOutput]:
        """Fail alone the requests a recovery found no longer fit (RankLoss._go_on); their outputs."""
        unfit, self._unfit = self._unfit or [], None
        return [self._fail_alone(group, why) for group, why in unfit]

    def _forget(self, group: RequestGroup) -> None:
        """Drop a finished group: its last output has been made."""
        del self.groups[group.request_id]
        for req in group.samples:
            del self.requests[req.request_id]

    def _accept(self, req: Request, verified: Verified, now: float) -> None:
        """Append a verify row's tokens one by one, as if each had been sampled in a step of
        its own (a stop condition drops the rest), then discard the rejected drafts' KV."""
        assert self.spec is not None  # only a SpecDecoder drafts
        num_drafts = len(req.spec_token_ids)
        self.spec.record(req, num_drafts, len(verified.token_ids) - 1)
        for token, lp in zip(verified.token_ids, verified.logprobs):
            req.output_token_ids.append(token)
            req.num_computed_tokens = req.num_tokens - 1  # the tokens before this one are cached
            if self.output_processor.add_token(req, lp, now):
                self.scheduler.finish(req)
            if req.finished:  # its blocks are freed already
                req.spec_token_ids = []
                return
        self.scheduler.rollback(req)

    def close(self) -> None:
        """Release the executor (and the worker ranks, if any)."""
        self.structured.close()
        if self.executor is not None:
            self.executor.close()
            self.executor = None  # type: ignore[assignment]


def _saved_generators(
    requests: Sequence[Request], saved: dict[int, tuple[torch.Generator, torch.Tensor]]
) -> dict[int, tuple[torch.Generator, torch.Tensor]]:
    """``saved`` with the states of the requests' generators not in it yet (by generator id)."""
    for r in requests:
        if r.generator is not None:
            saved.setdefault(id(r.generator), (r.generator, r.generator.get_state()))
    return saved


def _restore_generators(saved: dict[int, tuple[torch.Generator, torch.Tensor]]) -> None:
    for g, state in saved.values():
        g.set_state(state)
