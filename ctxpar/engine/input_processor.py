"""Request intake (vLLM's InputProcessor): prompts in, checked EngineRequests out, and the
samples of each request the engine queues.

Every entry point (LLM, LLMEngine, AsyncLLM and so the server, and
``Engine.add_request`` given token ids) turns a prompt into an EngineRequest
here, once, before anything is queued: so a bad request raises a CtxparError
and leaves the requests in flight untouched, and a batch is checked whole
before any of it is queued. The EngineRequest holds the engine's own copy of
the params: changing the caller's object (or its lists) later cannot reach a
request in flight. It holds too what its params cost to prepare: its bad words
as token ids, its stop strings' automaton and its compiled grammar, made here, on
the caller's thread (the server's: a worker thread), never on the engine thread,
where a request's thousand bad words or a slow schema would stall every step.

When the engine queues a request, ``make_group`` makes its samples: each with
its own generator (seeded: its draws never depend on the rest of the batch)
and its detokenizer.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ctxpar.engine.detokenizer import IncrementalDetokenizer
from ctxpar.engine.request import Request, RequestGroup
from ctxpar.engine.sample.grammar import RequestGrammar
from ctxpar.engine.stop_strings import StopStrings
from ctxpar.engine.validation import check_request
from ctxpar.errors import CtxparError
from ctxpar.inputs import PromptType, parse_prompt
from ctxpar.outputs import RequestMetrics
from ctxpar.sampling_params import SEED_MAX, SamplingParams, StructuredOutputsParams


@dataclass(frozen=True)
class EngineRequest:
    """A prompt checked against the engine, with the engine's own copy of its params: what
    ``Engine.add_request`` queues without checking again (vLLM's EngineCoreRequest)."""

    prompt_token_ids: list[int]  # the last ``truncate_prompt_tokens`` of them, where set
    params: SamplingParams
    prompt: str | None = None  # the prompt's text, where it had one
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # of params.bad_words
    stop: StopStrings = field(default_factory=lambda: StopStrings([]))  # of params.stop_strings
    grammar: Future | None = None  # params.structured_outputs compiled (done)
    priority: int = 0  # vLLM's request priority: lower is scheduled earlier (the server's field)


class InputProcessor:
    """Checks prompts against the model and the engine, and makes a request's samples."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_logprobs: int,
        seed: int,
        max_model_len: Callable[[], int],
        compile_grammar: Callable[[StructuredOutputsParams], Future],
    ) -> None:
        """tokenizer: None without one (prompts must be token ids); seed: the engine's, from
        which unseeded requests draw theirs; max_model_len: the engine's limit now (a lost
        DCP rank can lower it); compile_grammar: the engine's grammar compile (a Future)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self.seed = seed
        self.max_model_len = max_model_len
        self.compile_grammar = compile_grammar
        # Unseeded requests draw from the OS's randomness instead of (seed, arrival index):
        # the server sets it, where the n-th request after a restart must not be predictable
        # to a client; offline, reproducible runs are the point of the engine seed.
        self.os_random_seeds = False

    def process_inputs(self, prompt: PromptType, params: SamplingParams | None) -> EngineRequest:
        """Tokenize (a string or TextPrompt) and check one prompt of any of vLLM's forms."""
        params = _sampling_params(params)
        text, ids, salt = parse_prompt(prompt, self.tokenizer)
        return self.process_tokens(ids, params, text, salt)

    def process_tokens(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None,
        prompt: str | None = None,
        cache_salt: str | None = None,
    ) -> EngineRequest:
        """Check a tokenized prompt (its text, if any, in ``prompt``) and its params on their
        current values; cache_salt: the prompt's, set on the engine's copy of the params.
        Raises CtxparError naming the bad value and the limit."""
        params = _sampling_params(params)
        ids = check_request(
            prompt_token_ids,
            params,
            max_model_len=self.max_model_len(),
            vocab_size=self.vocab_size,
            max_logprobs=self.max_logprobs,
            has_tokenizer=self.tokenizer is not None,
        )
        params = params.clone()  # checked: its copy is too (a deep copy keeps every derived field)
        if cache_salt is not None:
            params.cache_salt = cache_salt  # this prompt's: the caller's params may serve others
        bad_words = self._bad_words_token_ids(params.bad_words or [])
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.compile_grammar(params.structured_outputs)
            grammar.result()  # a bad spec fails here, alone (its compile is bounded in time)
        return EngineRequest(ids, params, prompt, bad_words, StopStrings(params.stop_strings), grammar)

    def make_group(
        self,
        request: EngineRequest,
        request_id: str,
        arrival_index: int,
        arrival_time: float,
        grammar: Future | None,
        eos_token_ids: Sequence[int],
    ) -> RequestGroup:
        """The request's group of samples (``n``, or ``best_of``), in vLLM's ids (``i_id`` where
        there are several); the first is to be scheduled, the others are held until its prompt
        is computed (they then share its KV blocks). grammar: its compile, when constrained;
        eos_token_ids: banned with the stop ids until ``min_tokens`` (unless ignore_eos)."""
        ids, params = request.prompt_token_ids, request.params
        k = params.num_samples
        sample_ids = [request_id] if k == 1 else [f"{i}_{request_id}" for i in range(k)]
        assert params.stop_token_ids is not None  # validate() made it a list
        banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
        max_model_len = self.max_model_len()
        group = RequestGroup(request_id, request.prompt, ids, params, samples=[])
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        metrics = RequestMetrics(arrival_time=arrival_time)  # one request to the caller: one clock
        for i, sid in enumerate(sample_ids):
            req = Request(
                request_id=sid,
                prompt_token_ids=ids,
                params=params,
                arrival_index=arrival_index,
                metrics=metrics,
                generator=self._generator(params, arrival_index, i),
                prompt=request.prompt,
                max_total_tokens=min(len(ids) + (params.max_tokens or max_model_len), max_model_len),
                bad_words_token_ids=request.bad_words_token_ids,
                min_tokens_banned=banned,
                group=group,
                index=i,
                # Prompt logprobs need every prompt token's hidden state: no prefix-cache reads.
                skip_prefix_cache=i == 0 and params.prompt_logprobs is not None,
                grammar=RequestGrammar(grammar) if grammar is not None else None,
                priority=request.priority,
            )
            req.detokenizer = IncrementalDetokenizer(
                self.tokenizer if params.detokenize else None,
                ids,
                request.stop,
                params.skip_special_tokens,
                params.spaces_between_special_tokens,
                params.include_stop_str_in_output,
                params.min_tokens,
            )
            group.samples.append(req)
        group.held = group.samples[1:]
        return group

    def _generator(self, params: SamplingParams, index: int, sample: int) -> torch.Generator | None:
        """Sample ``sample``'s own RNG: its draws never depend on the rest of the batch."""
        if params.greedy:
            return None
        seed = params.seed
        if seed is not None:
            seed += sample  # vLLM's seed of sample i; wrapped into the 64 bits manual_seed takes
            if seed > SEED_MAX:
                seed -= 1 << 64
        elif self.os_random_seeds:
            seed = secrets.randbits(64)
        else:
            # Unseeded: seeded from the engine seed and the arrival index, so runs are reproducible.
            entropy = (self.seed, index) if sample == 0 else (self.seed, index, sample)
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


def _sampling_params(params: SamplingParams | None) -> SamplingParams:
    """The params of a request (None: the defaults); a CtxparError if they are not SamplingParams."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise CtxparError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    return params
