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
import operator
import time
from collections.abc import Sequence

import numpy as np
import torch

from ctxpar.config import EngineConfig
from ctxpar.engine.block_manager import BlockManager
from ctxpar.engine.detokenizer import IncrementalDetokenizer
from ctxpar.engine.request import Request
from ctxpar.engine.scheduler import Scheduler
from ctxpar.errors import CtxparError
from ctxpar.layers.sampler import Sampler
from ctxpar.outputs import CompletionOutput, RequestMetrics, RequestOutput
from ctxpar.sampling_params import SamplingParams


class Engine:
    """Continuous-batching inference engine for one model."""

    def __init__(self, config: EngineConfig) -> None:
        from ctxpar.models.loader import load_model
        from ctxpar.parallel.preflight import check_launch
        from ctxpar.worker.executor import DTYPES, resolve_device, start_executor
        from ctxpar.worker.kv_cache import kv_bytes_per_token_per_layer, num_kv_blocks

        self.config = config
        check_launch(config)  # how the ranks are started: refused before the model load if it cannot work
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)  # loading (dequantisation) uses them too
        dtype = DTYPES[config.dtype]
        self.loaded = load_model(config.model, dtype, resolve_device(config), config.max_model_len)
        model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len: int = self.loaded.max_model_len
        self.vocab_size: int = int(self.loaded.hf_config.vocab_size)
        self.eos_token_ids: set[int] = set(self.loaded.eos_token_ids)
        self.kv_bytes_per_token_per_layer = kv_bytes_per_token_per_layer(model.kv_entry_shape, dtype)
        self.num_blocks = num_kv_blocks(
            config.num_kv_blocks,
            config.kv_cache_bytes,
            config.block_size,
            tuple(model.kv_entry_shape),
            model.num_kv_layers,
            dtype,
            self.max_model_len,
            next(model.parameters()).device,
            config.dcp_size,
        )
        # Under DCP a logical block (the unit allocated, counted and hashed for prefix
        # caching) is block_size * D tokens; each rank stores block_size of them.
        self.block_manager = BlockManager(
            self.num_blocks, config.block_size * config.dcp_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler()
        self.executor = start_executor(config, self.loaded, self.num_blocks)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._arrivals = itertools.count()
        self.num_steps = 0

    # -- requests -----------------------------------------------------------

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """Check a request without queuing it; returns the ids as a list of ints.

        Raises CtxparError naming the bad value and the limit.
        """
        if not isinstance(params, SamplingParams):
            raise CtxparError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        # The same checks as at construction, on the current values: fields may
        # have been set since (sp.stop = [...], sp.max_tokens = 0).
        params.validate()
        try:
            ids = [operator.index(t) for t in prompt_token_ids]
        except TypeError:
            raise CtxparError("prompt_token_ids must be a sequence of integers") from None
        if not ids:
            raise CtxparError("the prompt is empty: it needs at least one token")
        if len(ids) >= self.max_model_len:
            raise CtxparError(
                f"the prompt has {len(ids)} tokens; max_model_len={self.max_model_len} allows at most "
                f"{self.max_model_len - 1} (room must be left for one generated token)"
            )
        bad = next(((i, t) for i, t in enumerate(ids) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise CtxparError(
                f"prompt token {bad[0]} has id {bad[1]}, outside the vocabulary [0, {self.vocab_size})"
            )
        if params.stop_strings and self.tokenizer is None:
            raise CtxparError("stop strings need a tokenizer, and this model has none")
        return ids

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        prompt: str | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id."""
        params = params if params is not None else SamplingParams()
        ids = self.validate(prompt_token_ids, params)
        # A private, validated copy: changing the caller's object later cannot
        # reach a request in flight.
        params = dataclasses.replace(params)
        index = next(self._arrivals)
        request_id = request_id if request_id is not None else str(index)
        if request_id in self.requests:
            raise CtxparError(f"request id {request_id!r} is already in use")
        generator = None
        if not params.greedy:
            # An unseeded request still gets its own generator, seeded from the
            # engine seed and its arrival index: runs are reproducible, and its
            # draws never depend on the rest of the batch.
            seed = params.seed
            if seed is None:
                seed = int(np.random.SeedSequence((self.config.seed, index)).generate_state(1)[0])
            generator = torch.Generator().manual_seed(seed)
        req = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            arrival_index=index,
            metrics=RequestMetrics(arrival_time=time.perf_counter()),
            generator=generator,
            prompt=prompt,
            max_total_tokens=min(len(ids) + params.max_tokens, self.max_model_len),
        )
        self.requests[request_id] = req
        self._detok[request_id] = IncrementalDetokenizer(
            self.tokenizer, ids, params.stop_strings, params.skip_special_tokens
        )
        self.scheduler.add(req)
        return request_id

    def abort(self, request_id: str) -> None:
        """Drop a request (e.g. a stream the caller stopped reading)."""
        req = self.requests.pop(request_id, None)
        if req is not None and not req.finished:
            req.finish_reason = "abort"
            self.scheduler.finish(req)
        self._detok.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop -----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the requests that got a new token (finished
        ones included, each for the last time: the engine then forgets them).

        A step is all or nothing. If running or sampling it raises (any
        exception, KeyboardInterrupt included), no request has advanced: each
        keeps its computed-token count, its tokens and its RNG state, so the
        step is simply scheduled again. The exception goes to the caller.
        """
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        now = time.perf_counter()
        for req in batch.requests:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
        sampling = [r for r, need in zip(batch.requests, batch.plan.needs_logits) if need]
        generators = [r.generator for r in sampling]
        # Rows sampled before a failing one have drawn from their generators already.
        rng_states = [g.get_state() if g is not None else None for g in generators]
        try:
            logits = self.executor.execute(batch.plan)
            out = self.sampler(logits, [r.params for r in sampling], generators)
        except BaseException:
            for g, state in zip(generators, rng_states):
                if g is not None:
                    g.set_state(state)
            raise
        # Success: record the tokens, then commit. In this order an interruption in
        # between still leaves a valid request (a known token not yet cached is recomputed).
        for req, token in zip(sampling, out.token_ids):
            req.output_token_ids.append(token)
        self.scheduler.commit(batch)
        self.num_steps += 1
        now = time.perf_counter()
        outputs = []
        for req, lp in zip(sampling, out.logprobs):
            self._check_new_token(req, lp, now)
            outputs.append(self._output(req))
            if req.finished:
                del self.requests[req.request_id]
                del self._detok[req.request_id]
        return outputs

    def _check_new_token(self, req: Request, logprobs: dict[int, float] | None, now: float) -> None:
        """Metrics, logprobs, text and stop conditions of the token just appended."""
        token = req.output_token_ids[-1]
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        if logprobs is not None and req.logprobs is not None:
            req.logprobs.append(logprobs)
        p = req.params
        detok = self._detok[req.request_id]
        if token in p.stop_token_ids:
            reason, stop = "stop", token
        elif not p.ignore_eos and token in self.eos_token_ids:
            reason, stop = "stop", None  # like vLLM: EOS has no stop_reason
        else:
            # A stop or EOS token adds no text; any other token does.
            stop = detok.add(token)
            reason = "stop" if stop is not None else None
            if reason is None and req.num_tokens >= req.max_total_tokens:
                reason = "length"
        if reason is None:
            return
        if not isinstance(stop, str):
            detok.flush()
        req.finish_reason, req.stop_reason = reason, stop
        req.metrics.finished_time = now
        self.scheduler.finish(req)

    def _output(self, req: Request) -> RequestOutput:
        detok = self._detok[req.request_id]
        completion = CompletionOutput(
            index=0,
            text=detok.visible_text(req.finished),
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            stop_reason=req.stop_reason,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=req.finished,
            metrics=req.metrics,
            num_cached_tokens=req.num_cached_tokens or 0,
        )

    def close(self) -> None:
        """Release the executor (and the worker ranks, if any)."""
        if self.executor is not None:
            self.executor.close()
            self.executor = None  # type: ignore[assignment]
