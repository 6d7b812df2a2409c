"""SamplingParams: how one request chooses its tokens and when it stops.

The fields and their defaults follow vLLM's ``SamplingParams`` so code written
for vLLM's offline API runs unchanged. Values are validated once, at
construction, with messages that name the value and the limit: a bad value must
fail before any work is queued.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ctxpar.errors import CtxparError


@dataclass
class SamplingParams:
    """Per-request sampling and stopping settings.

    temperature: 0 means greedy (argmax); > 0 scales the logits before softmax.
    top_k: keep the k most likely tokens; -1 disables.
    top_p: keep the smallest set of tokens whose probability reaches top_p; 1 disables.
    min_p: drop tokens whose probability is below min_p times the most likely one's; 0 disables.
    seed: per-request random seed. The same seed gives the same tokens whatever
        else is in the batch; None draws a seed from the engine's own seed.
    max_tokens: most tokens to generate.
    stop: strings that end generation; the text is cut before the stop string.
    stop_token_ids: token ids that end generation (besides the model's EOS).
    ignore_eos: keep generating past the model's EOS tokens.
    logprobs: if set to N, return for each generated token a dict
        {token_id: logprob} of the N most likely tokens plus the sampled one,
        from log_softmax of the raw logits (before temperature), as vLLM does.
    skip_special_tokens: leave special tokens out of the text.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # Normalised view of `stop`, always a list (filled in __post_init__).
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise CtxparError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_num(self.temperature) or self.temperature < 0:
            raise CtxparError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise CtxparError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1 or self.top_k == 0:
            raise CtxparError(f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise CtxparError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not is_int(self.seed):
            raise CtxparError(f"seed must be an integer or None, got {self.seed!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise CtxparError(f"logprobs must be an integer >= 0 or None, got {self.logprobs!r}")
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        elif self.stop is None:
            self.stop_strings = []
        else:
            self.stop_strings = list(self.stop)
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise CtxparError(f"stop strings must be non-empty strings, got {s!r}")
        ids = self.stop_token_ids or []
        for t in ids:
            if not is_int(t) or t < 0:
                raise CtxparError(f"stop_token_ids must be integers >= 0, got {t!r}")
        self.stop_token_ids = list(ids)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax at every step."""
        return self.temperature == 0
