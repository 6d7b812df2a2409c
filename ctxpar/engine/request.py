"""The state of one request as the engine and scheduler see it.

Only rank 0 holds requests; the model runners see nothing but step plans.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ctxpar.engine.detokenizer import IncrementalDetokenizer
from ctxpar.engine.sample.grammar import RequestGrammar
from ctxpar.outputs import PromptLogprobs, RequestMetrics, SampleLogprobs
from ctxpar.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks and is scheduled every step it fits
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One prompt and its generation.

    The tokens a request "knows" are its prompt followed by its outputs. Every
    known token except the last sampled one ends up in the KV cache;
    ``num_computed_tokens`` says how many are there now. A preempted request
    drops its cache (num_computed_tokens = 0) and recomputes all known tokens,
    prompt and outputs alike, so its output is unchanged.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_index: int  # global arrival order: lower is older
    metrics: RequestMetrics
    generator: torch.Generator | None  # per-request RNG: sampling independent of the batch
    prompt: str | None = None
    max_total_tokens: int = 1 << 62  # stop with "length" once prompt + outputs reach this
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None  # with logprobs (or best_of): sum of the sampled tokens'
    # What the sampler's logits processing needs (ctxpar.engine.sample.sampler.TokenHistory).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    min_tokens_banned: list[int] = field(default_factory=list)  # EOS and stop ids, banned until min_tokens
    detokenizer: IncrementalDetokenizer | None = None
    group: RequestGroup | None = None  # the prompt's samples this one belongs to
    index: int = 0  # which sample of its group
    skip_prefix_cache: bool = False  # compute every prompt token (prompt logprobs need their hidden states)
    grammar: RequestGrammar | None = None  # structured outputs: where this sample is in its grammar
    priority: int = 0  # vLLM's: lower is scheduled earlier (scheduler.py)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Prefix caching: hash chain of the full blocks of the known tokens, grown
    # lazily (tokens never change once known, so neither do the hashes).
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    # Speculative decoding: tokens drafted after the known ones, verified (as one row with the
    # last known token) in the next step; never part of the known tokens, the KV cache or its hashes.
    spec_token_ids: list[int] = field(default_factory=list)
    # Detokenized output; `text` is what may be shown (prefix-stable while streaming).
    text: str = ""

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.logprobs is not None or self.params.num_samples > self.params.n:
            self.cumulative_logprob = 0.0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus generated."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Known tokens in [start, end), across the prompt/output boundary."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_decode_ready(self) -> bool:
        """Everything but the last sampled token is cached and the prompt is
        done: the next step is a one-token decode."""
        return self.num_computed_tokens == self.num_tokens - 1 and self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(eq=False)
class RequestGroup:
    """The samples of one prompt (SamplingParams.n, best_of): one request to the caller.

    With several samples, only the first is scheduled at first; the others
    wait in ``held`` until its prompt is computed, then start from the prefix
    cache, so the prompt's full KV blocks are computed once and shared.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[Request]  # by index
    held: list[Request] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None  # filled from the first sample's prompt steps

    @property
    def finished(self) -> bool:
        return not self.held and all(r.finished for r in self.samples)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs requested and not all collected yet (entries 1..P-1 come from positions 0..P-2)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)
