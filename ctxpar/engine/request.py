"""The state of one request as the engine and scheduler see it.

Only rank 0 holds requests; the model runners see nothing but step plans.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ctxpar.outputs import RequestMetrics
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
    logprobs: list[dict[int, float]] | None = None
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Prefix caching: hash chain of the full blocks of the known tokens, grown
    # lazily (tokens never change once known, so neither do the hashes).
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    # Detokenized output; `text` is what may be shown (prefix-stable while streaming).
    text: str = ""

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []

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
