"""What a finished (or streaming) request hands back, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log probability of one token at one position, as vLLM reports it.

    logprob: from log_softmax of the raw logits (before penalties and temperature).
    rank: 1 + the number of tokens more likely than this one (the argmax has rank 1).
    decoded_token: the token decoded on its own; None with detokenize=False or no tokenizer.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: the sampled (or prompt) token first, then the top-N.
LogprobsOnePosition = dict[int, Logprob]
SampleLogprobs = list[LogprobsOnePosition]
PromptLogprobs = list[LogprobsOnePosition | None]  # first entry None: the first token has no context


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    text: the detokenized output; while streaming, the part that is final (text
        that could still turn out to be the start of a stop string is held back).
    token_ids: every generated token id (a stop token included, as in vLLM).
    cumulative_logprob: the sum of the sampled tokens' logprobs; None unless
        SamplingParams.logprobs is set (or best_of ranks the samples), as in vLLM.
    logprobs: with SamplingParams.logprobs=N, one {token_id: Logprob} per token.
    finish_reason: "stop" (EOS, stop token or stop string), "length"
        (max_tokens or max_model_len), or None while running.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        """Whether this sequence has stopped (a method, as vLLM's)."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.perf_counter seconds) of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding, over all the request's samples: verify rows (steps with drafts),
    # tokens drafted, and drafts accepted.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts / drafted tokens; None without drafts."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per verify step (accepted drafts plus the verifier's own, vLLM's
        mean acceptance length); None without drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first sampled token, in seconds."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """A request's prompt and its output so far (``finished`` once every sample stopped).

    outputs: one CompletionOutput per sample (SamplingParams.n), by index.
    prompt_logprobs: with SamplingParams.prompt_logprobs=N, one entry per
        prompt token, the first None (as vLLM); None otherwise.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False, default=None)  # type: ignore[assignment]
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of computed
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def ttft(self) -> float | None:
        """Shortcut for metrics.ttft."""
        return self.metrics.ttft if self.metrics is not None else None
