"""Beam search, as vLLM's offline ``LLM.beam_search``.

The search runs on top of the engine: each step asks for one token of every
live beam with ``logprobs=2 * beam_width`` and extends each beam by every
candidate returned (2 * beam_width per beam, as Hugging Face does, so that
beams ending in EOS still leave beam_width to go on). Beams share their prompt
and their common prefix through the prefix cache, so a step recomputes only
the tail block of each beam.

Scores are vLLM's: cumulative logprob / length ** length_penalty, where the
length counts the prompt too and leaves out a final EOS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ctxpar.sampling_params import BeamSearchParams


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` holds the prompt and the generated tokens, ``text``
    their decoding (as vLLM, the prompt included); ``logprobs`` has one dict of
    candidates per generated token."""

    tokens: list[int]
    logprobs: list[dict[int, Any]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length" (max_tokens or max_model_len)
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def logprob_value(entry: Any) -> float:
    """A logprob entry's value: a float, or a ``Logprob`` object's ``.logprob``."""
    return float(getattr(entry, "logprob", entry))


def beam_score(beam: BeamSearchSequence, eos_token_ids: set[int], length_penalty: float) -> float:
    length = len(beam.tokens) - (beam.tokens[-1] in eos_token_ids)
    return beam.cum_logprob / length**length_penalty


# Token lists -> for each, the candidates {token id: logprob entry} of its next token.
NextLogprobs = Callable[[list[list[int]]], list[dict[int, Any]]]


def run_beam_search(
    prompts: list[list[int]],
    params: BeamSearchParams,
    next_logprobs: NextLogprobs,
    eos_token_ids: set[int],
    max_model_len: int,
    on_step: Callable[[], Any] | None = None,
) -> list[list[BeamSearchSequence]]:
    """The best beams of each prompt, best first.

    on_step: called after each step (a progress bar's update, say).
    """
    eos = set() if params.ignore_eos else set(eos_token_ids)

    def score(beam: BeamSearchSequence) -> float:
        return beam_score(beam, eos, params.length_penalty)

    live = [[BeamSearchSequence(tokens=list(p))] for p in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        # A beam at the context limit cannot take another token: it is complete.
        for beams, finished in zip(live, done):
            for b in [b for b in beams if len(b.tokens) >= max_model_len]:
                b.finish_reason = "length"
                finished.append(b)
                beams.remove(b)
        flat = [b for beams in live for b in beams]
        if not flat:
            break
        candidates = iter(next_logprobs([b.tokens for b in flat]))
        for i, beams in enumerate(live):
            grown = []
            for beam in beams:
                cands = next(candidates)
                for token, entry in cands.items():
                    new = BeamSearchSequence(
                        tokens=beam.tokens + [token],
                        logprobs=beam.logprobs + [cands],
                        cum_logprob=beam.cum_logprob + logprob_value(entry),
                    )
                    if token in eos:
                        new.finish_reason = "stop"
                        done[i].append(new)
                    else:
                        grown.append(new)
            live[i] = sorted(grown, key=score, reverse=True)[: params.beam_width]
        if on_step is not None:
            on_step()
    results = []
    for beams, finished in zip(live, done):
        for b in beams:
            b.finish_reason = b.finish_reason or "length"
        results.append(sorted(finished + beams, key=score, reverse=True)[: params.beam_width])
    return results
