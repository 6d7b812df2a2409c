"""Verification of drafted tokens: which of them a request keeps, and its next token.

A verify row computed the last known token and the k drafts, so it has k + 1
logits rows: row i is the target model's distribution p_i of the token after
draft i (row 0: after the last known token). Walking the drafts in order:

- greedy: draft i is kept while it equals argmax p_i; at the first mismatch the
  argmax is emitted instead, and after k kept drafts argmax p_k is the bonus
  token. The tokens are exactly those of decoding without drafts.
- sampled (vLLM's rejection sampler): draft x with draft probability q(x) is
  kept with probability min(1, p(x) / q(x)); on rejection a token is drawn from
  the residual max(p - q, 0), normalised, and the walk stops; after k kept
  drafts the bonus token is drawn from p_k. Every emitted token then has
  exactly the target distribution. N-gram drafts are a point mass (q(x) = 1):
  keep x with probability p(x); the residual is p without x.

p is what plain sampling would draw from: the logits after the request's
processing (penalties, masks, bias: with the drafts kept so far counted as
output), then temperature, min-p, top-k and top-p. The request's own generator
draws every uniform and every token, so seeded requests are reproducible.

``verify_drafts`` verifies a step's verify rows, each with its request's
settings and generator, and gives the logprobs of the tokens they emit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ctxpar.engine.request import Request
from ctxpar.engine.sample.sampler import TokenHistory, apply_filters, apply_logits_processing, draw_token, logprobs_of
from ctxpar.outputs import Logprob
from ctxpar.sampling_params import SamplingParams

# The distributions (k, V) a request's drafts were drawn from (a draft model's sampled drafts),
# or None where they are point masses (n-gram drafts, or drafts a greedy draft model chose).
DraftProbs = Callable[[Request], torch.Tensor | None]


@dataclass
class Verified:
    """What one verify row emits: tokens (1 to k + 1) and, where wanted, their logprobs."""

    request: Request
    num_drafts: int  # the drafts it verified
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]

    @property
    def num_accepted(self) -> int:
        """Drafts kept: every emitted token but the last, which the target model chose."""
        return len(self.token_ids) - 1


def verify_drafts(
    requests: Sequence[Request], logits: torch.Tensor, starts: Sequence[int], draft_probs: DraftProbs | None
) -> list[Verified]:
    """Verify each request's drafts; its logits rows are ``logits[start : start + k + 1]``."""
    out = []
    for req, start in zip(requests, starts):
        drafts = req.spec_token_ids
        rows = logits[start : start + len(drafts) + 1]  # (k + 1, V)
        probs = draft_probs(req) if draft_probs is not None else None
        q = probs[: len(drafts)] if probs is not None else None  # (k, V); the scheduler may have cut drafts
        tokens = verify_row(rows, drafts, req.params, req.generator, req, q)
        n = req.params.logprobs
        if n is None and req.cumulative_logprob is not None:
            n = 0  # best_of ranks samples by the sampled tokens' logprobs
        lps: list[dict[int, Logprob] | None]
        lps = list(logprobs_of(rows[: len(tokens)].cpu(), tokens, n)) if n is not None else [None] * len(tokens)
        out.append(Verified(req, len(drafts), tokens, lps))
    return out


@dataclass
class DraftedHistory:
    """A request's history with the drafts kept so far counted as output (for logits processing)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    bad_words_token_ids: list[list[int]]
    min_tokens_banned: list[int]


def drafted_history(h: TokenHistory, kept: Sequence[int]) -> TokenHistory:
    """``h`` with the tokens ``kept`` appended to its output."""
    if not kept:
        return h
    return DraftedHistory(
        h.prompt_token_ids, h.output_token_ids + list(kept), h.bad_words_token_ids, h.min_tokens_banned
    )


def verify_row(
    logits: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    history: TokenHistory,
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """The tokens a verify row emits: the kept drafts, then one more (1 to k + 1 tokens).

    logits: (k + 1, V) float32 raw logits of the row's positions; drafts: the k drafts.
    draft_probs: (k, V) the distributions the drafts were drawn from (a draft model's);
        None: point masses (n-gram drafts, or drafts a greedy draft model chose).
    """
    k = len(drafts)
    if params.greedy and not params.processes_logits:
        # One argmax over every position: the common path, no per-position work.
        best = torch.argmax(logits, dim=-1).tolist()  # (k + 1,)
        kept = next((i for i in range(k) if best[i] != drafts[i]), k)
        return list(drafts[:kept]) + [best[kept]]
    logits = logits.float().cpu()  # the request's CPU generator draws on the host (as the Sampler's rows)
    out: list[int] = []
    for i in range(k + 1):
        x = logits[i]
        if params.processes_logits:
            x = apply_logits_processing(x, params, drafted_history(history, out))
        if params.greedy:
            token = int(torch.argmax(x))
            out.append(token)
            if i == k or token != drafts[i]:
                return out
            continue
        probs = torch.softmax(apply_filters(x, params), dim=-1)  # (V,) p_i
        if i == k:  # every draft kept: the bonus token, from p_k
            out.append(draw_token(probs, generator))
            return out
        draft = drafts[i]
        q = float(draft_probs[i, draft]) if draft_probs is not None else 1.0
        if float(torch.rand((), generator=generator)) * q < float(probs[draft]):  # u < p / q
            out.append(draft)
            continue
        if draft_probs is None:
            residual = probs.clone()
            residual[draft] = 0.0  # max(p - q, 0) for a point mass q at the draft
        else:
            residual = (probs - draft_probs[i]).clamp_(min=0.0)
        # A residual of zero mass means p <= q everywhere, i.e. p = q, which the draw
        # above always keeps; kept as a guard against rounding.
        if float(residual.sum()) <= 0.0:
            residual = probs
        out.append(draw_token(residual, generator))
        return out
    raise AssertionError("unreachable: the last position always returns")
