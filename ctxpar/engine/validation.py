"""Checks of a request against the engine that will run it, before it is queued.

SamplingParams checks its own fields; what depends on the model and the
engine (context length, vocabulary, tokenizer, ``max_logprobs``) is checked
here, on the values the params hold when the request is added.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from ctxpar.errors import CtxparError
from ctxpar.sampling_params import ALL_LOGPROBS, SamplingParams


def check_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    max_model_len: int,
    vocab_size: int,
    max_logprobs: int,
    has_tokenizer: bool,
) -> list[int]:
    """The prompt's token ids as a list (the last ``truncate_prompt_tokens`` of
    them when set), or a CtxparError naming the bad value and the limit."""
    # The same checks as at construction, on the current values: fields may
    # have been set since (sp.stop = [...], sp.max_tokens = 0).
    params.validate()
    try:
        ids = [operator.index(t) for t in prompt_token_ids]
    except TypeError:
        raise CtxparError("prompt_token_ids must be a sequence of integers") from None
    if not ids:
        raise CtxparError("the prompt is empty: it needs at least one token")
    if params.truncate_prompt_tokens is not None:
        # Keep the end of the prompt, as vLLM does; -1: all that leaves room for one generated token.
        keep = max_model_len - 1 if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
        ids = ids[-keep:]
    if len(ids) >= max_model_len:
        raise CtxparError(
            f"the prompt has {len(ids)} tokens; max_model_len={max_model_len} allows at most "
            f"{max_model_len - 1} (room must be left for one generated token); shorten it or set "
            "truncate_prompt_tokens"
        )
    bad = next(((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise CtxparError(f"prompt token {bad[0]} has id {bad[1]}, outside the vocabulary [0, {vocab_size})")
    for name, what in (("stop_strings", "stop strings"), ("bad_words", "bad_words")):
        if getattr(params, name) and not has_tokenizer:
            raise CtxparError(f"{what} need a tokenizer, and this model has none")
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        num = vocab_size if value == ALL_LOGPROBS else value
        if num is not None and num > limit:
            raise CtxparError(
                f"{name}={value} asks for {num} logprobs per token, more than max_logprobs={max_logprobs}; "
                "ask for fewer, or create the LLM with a larger max_logprobs (-1: the whole vocabulary)"
            )
    for name, token_ids in (
        ("allowed_token_ids", params.allowed_token_ids or []),
        ("logit_bias", params.logit_bias or {}),
    ):
        out_of_vocab = [t for t in token_ids if t >= vocab_size]
        if out_of_vocab:
            raise CtxparError(f"{name} has token id(s) {out_of_vocab[:5]} outside the vocabulary [0, {vocab_size})")
    return ids
