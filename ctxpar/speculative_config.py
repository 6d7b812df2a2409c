"""SpeculativeConfig: how the engine drafts tokens to verify, spelled as vLLM's
``speculative_config`` (``LLM(speculative_config={...})``, ``--speculative-config JSON``).

Validated once, when built; the engine never mutates it. Checks that need the
model (a draft's vocabulary, a checkpoint's next-token-prediction layers) are
made when the engine loads it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ctxpar.checks import check_float, check_int
from ctxpar.errors import CtxparError

METHODS = ("ngram", "draft_model", "mtp")  # vLLM's names
MAX_SPECULATIVE_TOKENS = 64  # a verify row is 1 + k tokens; more only wastes compute


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: k tokens drafted per request per step, then verified in one forward pass.

    method: "ngram" (prompt lookup: the tokens that followed the last earlier occurrence
        of the sequence's own suffix, searched over the prompt and the output so far), or
        "draft_model" (a smaller model with the same vocabulary, ``model``, run in the same
        ranks with its own paged KV cache, drafts k tokens one at a time), or "mtp" (the
        next-token-prediction layer a DeepSeek-V3 checkpoint carries, fed the target's
        hidden states, drafts k tokens one at a time; models/deepseek_mtp.py).
    num_speculative_tokens: k, the most tokens drafted per request and step.
    prompt_lookup_min / prompt_lookup_max: the n-gram sizes searched, longest first; one
        given sets the other (as vLLM), neither gives 2 and 5.
    model: the draft model's path (a Hugging Face directory or .gguf file), for "draft_model";
        for "mtp", the checkpoint that holds the layer (default: the target's).
    max_model_len: the draft model's own context limit (default: its own, at most the
        target's); a request longer than that is decoded without drafts.
    min_acceptance_rate: a request whose acceptance rate over its last drafts falls below
        this stops drafting for a while (free text: drafts that are rarely right only cost).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    max_model_len: int | None = None
    min_acceptance_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise CtxparError(
                f"speculative_config method {self.method!r} is unknown; use one of {', '.join(map(repr, METHODS))}"
            )
        check_int(
            "speculative_config num_speculative_tokens",
            self.num_speculative_tokens,
            1,
            MAX_SPECULATIVE_TOKENS,
            why=" (the tokens drafted per step)",
        )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo, hi = 2, 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        check_int("speculative_config prompt_lookup_min", lo, 1)
        check_int("speculative_config prompt_lookup_max", hi, lo, why=" (at least prompt_lookup_min)")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        if self.method == "draft_model" and self.model is None:
            raise CtxparError("speculative_config method 'draft_model' needs model: the draft model's path")
        if self.method == "ngram" and self.model is not None:
            raise CtxparError("speculative_config model is only for method='draft_model' or 'mtp'; drop it for 'ngram'")
        check_int("speculative_config max_model_len", self.max_model_len, 2, none_ok=True)
        check_float("speculative_config min_acceptance_rate", self.min_acceptance_rate, 0.0, 1.0)

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """A SpeculativeConfig from what a user passes: None, a dict, a JSON string
        (the command line's ``--speculative-config``) or a SpeculativeConfig."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise CtxparError(f"speculative_config is not valid JSON ({e}): {value!r}") from e
        if not isinstance(value, dict):
            raise CtxparError(f"speculative_config must be a dict (or its JSON), got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise CtxparError(f"speculative_config: unknown keys {unknown}; known: {', '.join(sorted(known))}")
        if "num_speculative_tokens" not in value:
            raise CtxparError("speculative_config needs num_speculative_tokens (k >= 1, the tokens drafted per step)")
        return cls(**value)
