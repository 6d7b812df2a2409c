"""SamplingParams: how one request chooses its tokens and when it stops.

The fields and their defaults follow vLLM's ``SamplingParams`` so code written
for vLLM's offline API runs unchanged. Values are validated at construction
and again, on their current values, when a request enters the engine (the
object is mutable, as vLLM's is): a field set after construction is honoured
and checked, and a bad value fails before any work is queued, with a message
that names the field, the value and the allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ctxpar.checks import check_float, check_int, is_int
from ctxpar.errors import CtxparError

# torch.Generator.manual_seed takes any integer that fits 64 bits, signed or not.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
# Below this the tempered logits (logits / temperature) overflow float32 and
# sampling fails; use temperature 0 for greedy decoding.
MIN_TEMPERATURE = 1e-6


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
    # Normalised view of `stop`, always a list (re-derived by validate()).
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field's current value and re-derive ``stop_strings``.

        Raises CtxparError naming the field, the value and the allowed range.
        The engine calls this again when a request is added, so fields changed
        after construction are checked and honoured too.
        """
        check_int("max_tokens", self.max_tokens, 1)
        check_float("temperature", self.temperature, 0, why=" (0 = greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise CtxparError(
                f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE} (smaller ones overflow the "
                f"tempered logits), got {self.temperature!r}"
            )
        check_float("top_p", self.top_p, 0, 1, lo_open=True)
        if self.top_k != -1:
            check_int("top_k (-1 = off)", self.top_k, 1)
        check_float("min_p", self.min_p, 0, 1)
        check_int(
            "seed", self.seed, SEED_MIN, SEED_MAX, none_ok=True,
            why=" (64 bits, what torch.Generator.manual_seed takes)",
        )
        check_int("logprobs", self.logprobs, 0, none_ok=True)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise CtxparError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.stop, str):
            stops = [self.stop]
        elif self.stop is None:
            stops = []
        elif isinstance(self.stop, (list, tuple)):
            stops = list(self.stop)
        else:
            raise CtxparError(f"stop must be a string, a list of strings or None, got {self.stop!r}")
        for s in stops:
            if not isinstance(s, str) or not s:
                raise CtxparError(f"stop strings must be non-empty strings, got {s!r} in stop={self.stop!r}")
        ids = self.stop_token_ids if self.stop_token_ids is not None else []
        if not isinstance(ids, (list, tuple)):
            raise CtxparError(f"stop_token_ids must be a list of integers >= 0 or None, got {ids!r}")
        for t in ids:
            if not is_int(t) or t < 0:
                raise CtxparError(f"stop_token_ids must be integers >= 0, got {t!r} in stop_token_ids={ids!r}")
        self.stop_strings = stops
        self.stop_token_ids = list(ids)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax at every step."""
        return self.temperature == 0


# vLLM users import it from here (vllm.sampling_params.BeamSearchParams); it lives with the search.
from ctxpar.beam_search import BeamSearchParams  # noqa: E402,F401
