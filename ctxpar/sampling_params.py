"""SamplingParams: how one request chooses its tokens and when it stops.

The fields and their defaults follow vLLM's ``SamplingParams`` so code written
for vLLM's offline API runs unchanged. Values are validated at construction
and again, on their current values, when a request enters the engine (the
object is mutable, as vLLM's is): a field set after construction is honoured
and checked, and a bad value fails before any work is queued, with a message
that names the field, the value and the allowed range. Limits that depend on
the model (vocabulary, context length, ``max_logprobs``) are checked by the
engine when the request is added.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field
from typing import Any

from ctxpar.checks import check_float, check_int
from ctxpar.errors import CtxparError
from ctxpar.sampling_checks import (
    MAX_BAD_WORDS,
    MAX_STOP,
    check_logit_bias,
    check_structured_outputs,
    strings,
    token_ids,
)
from ctxpar.structured_params import StructuredOutputsParams

__all__ = ["BeamSearchParams", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]

# torch.Generator.manual_seed takes any integer that fits 64 bits, signed or not.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
# Below this the tempered logits (logits / temperature) overflow float32 and
# sampling fails; use temperature 0 for greedy decoding.
MIN_TEMPERATURE = 1e-6
MAX_N = 1024  # samples of one prompt (vLLM's limit is an environment variable; one request, one batch here)
ALL_LOGPROBS = -1  # logprobs / prompt_logprobs: the whole vocabulary


class RequestOutputKind(enum.Enum):
    """What each output of a request carries (vLLM's values): LLMEngine.step and
    AsyncLLM.generate honour it; LLM.generate returns finished outputs whatever it is."""

    CUMULATIVE = 0  # everything so far (text, token ids, logprobs)
    DELTA = 1  # only what is new since the request's previous output
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    """Per-request sampling and stopping settings (vLLM's fields and meanings).

    n: samples to return for the prompt; they share its prompt KV blocks.
    best_of: sample this many (>= n) and return the n with the highest
        cumulative logprob; None means n.
    presence_penalty, frequency_penalty: in [-2, 2]; subtracted from the logit
        of every token already generated, once (presence) or per occurrence (frequency).
    repetition_penalty: > 0; logits of tokens in the prompt or the output are
        divided by it when positive, multiplied when negative; 1 disables.
    temperature: 0 means greedy (argmax); > 0 scales the logits before softmax.
    top_k: keep the k most likely tokens; 0 or -1 disables.
    top_p: keep the smallest set of tokens whose probability reaches top_p; 1 disables.
    min_p: drop tokens whose probability is below min_p times the most likely one's; 0 disables.
    seed: per-request random seed. The same seed gives the same tokens whatever
        else is in the batch; None draws a seed from the engine's own seed (on a
        server, from the OS's randomness: no client can predict another's draws).
        With n > 1, sample i uses seed + i.
    stop: strings that end generation; the text is cut before the stop string
        (after it with include_stop_str_in_output).
    stop_token_ids: token ids that end generation (besides the model's EOS).
    bad_words: words never generated: the last token of a word is banned when
        the tokens before it were just generated (with and without a leading space).
    include_stop_str_in_output: keep the stop string that ended generation in the text.
    ignore_eos: keep generating past the model's EOS tokens.
    max_tokens: most tokens to generate; None: up to the model's context length.
    min_tokens: tokens generated before EOS, stop tokens or stop strings may end generation.
    logprobs: N returns for each generated token a dict {token_id: Logprob}
        of the N most likely tokens plus the sampled one, from log_softmax of
        the raw logits (before penalties and temperature), as vLLM does; -1:
        the whole vocabulary. At most the engine's ``max_logprobs``.
    prompt_logprobs: the same for each prompt token (the first entry is None).
        Such a request computes its whole prompt (no prefix-cache reads).
    detokenize: False leaves the output text empty (and allows no stop strings).
    skip_special_tokens: leave special tokens out of the text.
    spaces_between_special_tokens: passed on to the tokenizer's decode.
    logit_bias: {token_id: bias} added to the logits before sampling.
    allowed_token_ids: only these tokens may be generated.
    truncate_prompt_tokens: keep only the last k prompt tokens; -1: as many as
        the context allows.
    output_kind: RequestOutputKind: every output cumulative (the default), deltas, or the final one only.
    structured_outputs: StructuredOutputsParams: the output must match a JSON
        schema, a regex, a choice, a grammar (see its docstring). Logprobs are
        then those of the constrained distribution, as in vLLM.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Normalised view of `stop`, always a list (re-derived by validate()).
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)
    # The prefix cache's isolation key: vLLM's per-request ``cache_salt``, given with the
    # prompt ({"prompt": ..., "cache_salt": ...}) or in a server request, carried from
    # there to the engine's request here. Requests share cached KV blocks only with
    # requests of the same salt. Not in repr: a tenant's salt is its secret.
    cache_salt: str | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field's current value and re-derive ``stop_strings``.

        Raises CtxparError naming the field, the value and the allowed range.
        The engine calls this again when a request is added, so fields changed
        after construction are checked and honoured too.
        """
        check_int("max_tokens", self.max_tokens, 1, none_ok=True, why=" (None: up to max_model_len)")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise CtxparError(
                f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), got {self.output_kind!r}"
            )
        check_float("temperature", self.temperature, 0, why=" (0 = greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise CtxparError(
                f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE} (smaller ones overflow the "
                f"tempered logits), got {self.temperature!r}"
            )
        check_float("top_p", self.top_p, 0, 1, lo_open=True)
        if self.top_k not in (0, -1):
            check_int("top_k (0 or -1 = off)", self.top_k, 1)
        check_float("min_p", self.min_p, 0, 1)
        check_int(
            "seed",
            self.seed,
            SEED_MIN,
            SEED_MAX,
            none_ok=True,
            why=" (64 bits, what torch.Generator.manual_seed takes)",
        )
        self._check_counts()
        check_float("presence_penalty", self.presence_penalty, -2, 2)
        check_float("frequency_penalty", self.frequency_penalty, -2, 2)
        check_float("repetition_penalty", self.repetition_penalty, 0, lo_open=True, why=" (1 = off)")
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "include_stop_str_in_output",
            "detokenize",
            "spaces_between_special_tokens",
        ):
            if not isinstance(getattr(self, name), bool):
                raise CtxparError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise CtxparError(f"cache_salt must be a non-empty string, got {type(self.cache_salt).__name__}")
        self.stop_strings = strings("stop", self.stop, MAX_STOP)
        if self.stop_strings and not self.detokenize:
            raise CtxparError("stop strings need detokenize=True (they are matched in the text); drop one of them")
        self.stop_token_ids = token_ids("stop_token_ids", self.stop_token_ids, empty_ok=True)
        for word in strings("bad_words", self.bad_words, MAX_BAD_WORDS):
            if not word.strip():
                raise CtxparError(f"bad_words must hold words, not only spaces: got {word!r}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = token_ids("allowed_token_ids", self.allowed_token_ids, empty_ok=False)
        check_logit_bias(self.logit_bias)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        check_structured_outputs(self.structured_outputs, self.min_tokens, self.allowed_token_ids)

    def _check_counts(self) -> None:
        check_int("n", self.n, 1, MAX_N)
        if self.best_of is not None:
            check_int("best_of", self.best_of, self.n, MAX_N, why=f" (at least n={self.n!r})")
        if self.temperature == 0 and self.num_samples > 1:
            # As vLLM: greedy samples would all be the same sequence.
            raise CtxparError(
                f"n={self.n} and best_of={self.best_of} must be 1 with greedy sampling (temperature=0): every "
                "sample would be the same; set temperature > 0"
            )
        check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise CtxparError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens!r}; "
                "raise max_tokens or lower min_tokens"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value != ALL_LOGPROBS:
                check_int(name, value, 0, none_ok=True, why=" or -1 (the whole vocabulary)")
        if self.truncate_prompt_tokens != -1:
            check_int(
                "truncate_prompt_tokens",
                self.truncate_prompt_tokens,
                1,
                none_ok=True,
                why=" or -1 (keep what max_model_len allows)",
            )

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """vLLM's ``from_optional``: arguments given as None take their defaults
        (and logit_bias keys given as strings, as JSON has them, become ints)."""
        given = {k: v for k, v in kwargs.items() if v is not None}
        bias = given.get("logit_bias")
        if isinstance(bias, dict):
            try:
                given["logit_bias"] = {int(t): b for t, b in bias.items()}
            except (TypeError, ValueError):
                raise CtxparError(f"logit_bias keys must be token ids, got {list(bias)!r}") from None
        return cls(**given)

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's ``clone``): changing it leaves this one alone."""
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax at every step."""
        return self.temperature == 0

    @property
    def num_samples(self) -> int:
        """Sequences generated for the prompt: best_of, or n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def processes_logits(self) -> bool:
        """True when the logits are changed before sampling (penalties, bias, masks)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.min_tokens
            or self.logit_bias
            or self.bad_words
            or self.allowed_token_ids is not None
        )


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` (LLM.beam_search: ctxpar/entrypoints/beam_search.py).

    beam_width: beams kept per prompt; the output has up to this many sequences.
    max_tokens: most tokens generated per beam.
    ignore_eos: go on past EOS instead of completing the beam.
    temperature: applied to the logits before the candidates are drawn; 0
        (the default) takes the most likely ones.
    length_penalty: a beam's score is its cumulative logprob / length ** length_penalty.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        check_int("beam_width", self.beam_width, 1)
        check_int("max_tokens", self.max_tokens, 1)
        if not isinstance(self.ignore_eos, bool):
            raise CtxparError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        check_float("temperature", self.temperature, 0, why=" (0 = the most likely candidates)")
        lp = self.length_penalty
        if not (isinstance(lp, (int, float)) and not isinstance(lp, bool) and math.isfinite(lp)):
            raise CtxparError(f"length_penalty must be a finite number (1 = score by mean logprob), got {lp!r}")
