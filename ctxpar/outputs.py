"""What a finished (or streaming) request hands back, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    text: the detokenized output; while streaming, the part that is final (text
        that could still turn out to be the start of a stop string is held back).
    token_ids: every generated token id (a stop token included, as in vLLM).
    finish_reason: "stop" (EOS, stop token or stop string), "length"
        (max_tokens or max_model_len), or None while running.
    logprobs: with SamplingParams.logprobs=N, one {token_id: logprob} per token.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.perf_counter seconds) of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first sampled token, in seconds."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """A request's prompt and its output so far (``finished`` once it stopped)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False, default=None)  # type: ignore[assignment]
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of computed

    @property
    def ttft(self) -> float | None:
        """Shortcut for metrics.ttft."""
        return self.metrics.ttft if self.metrics is not None else None
