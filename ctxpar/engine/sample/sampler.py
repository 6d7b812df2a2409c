"""Token sampling: logits processors, greedy, temperature, top-k, top-p, min-p, logprobs.

Each row is sampled on its own with its request's ``torch.Generator``, so a
seeded request draws the same tokens whatever else shares its batch. Greedy
rows (temperature 0) without logits processing are one vectorised argmax.
Logits arrive in float32 and only for rows that sample (the executor
computes no others).

Order, as in vLLM: logprobs are taken from the raw logits. Then the logits
processors (allowed_token_ids, bad_words, min_tokens, logit_bias), then the
penalties (repetition, frequency, presence), then greedy argmax, or
temperature, min-p (relative to the most likely token of the tempered
distribution), top-k, top-p and a draw.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ctxpar.outputs import Logprob
from ctxpar.sampling_params import ALL_LOGPROBS, SamplingParams


class TokenHistory(Protocol):
    """What penalties and masks need to know of a row's request (ctxpar.engine.request.Request has it)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    bad_words_token_ids: list[list[int]]
    min_tokens_banned: list[int]  # EOS and stop token ids: banned until min_tokens are generated


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]  # per row; None where not requested


def apply_logits_processing(logits: torch.Tensor, p: SamplingParams, h: TokenHistory) -> torch.Tensor:
    """One row's (V,) logits after allowed_token_ids, bad_words, min_tokens,
    logit_bias and the penalties: what greedy and random sampling choose from."""
    x = logits.clone()
    neg_inf = float("-inf")
    if p.allowed_token_ids is not None:
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        x.masked_fill_(~keep, neg_inf)
    out = h.output_token_ids
    for word in h.bad_words_token_ids:
        # The word's last token is banned once the tokens before it were just generated.
        k = len(word) - 1
        if k <= len(out) and (k == 0 or out[-k:] == word[:-1]):
            x[word[-1]] = neg_inf
    if len(out) < p.min_tokens and h.min_tokens_banned:
        x[h.min_tokens_banned] = neg_inf
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        x[ids] += torch.tensor(list(p.logit_bias.values()), dtype=x.dtype)
    if p.repetition_penalty != 1:
        seen = torch.zeros_like(x, dtype=torch.bool)
        seen[torch.tensor(h.prompt_token_ids + out, dtype=torch.long)] = True
        x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
    if (p.frequency_penalty or p.presence_penalty) and out:
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.shape[-1]).to(x.dtype)
        x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(x.dtype)
    return x


def apply_filters(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Return the tempered logits of one row (V,) with filtered-out tokens at -inf."""
    x = logits / params.temperature
    if params.min_p > 0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1:
        x = top_p_filter(x, params.top_p)
    return x


TOP_P_FIRST = 64  # candidates of a top-p cut's first try; a model's nucleus is usually smaller


def top_p_filter(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """One row's (V,) logits with -inf outside the nucleus: a token is kept if the mass
    of the tokens ranked before it is still below top_p (the smallest set that reaches
    top_p; the most likely token always survives).

    The ranking is computed over the k most likely tokens only, k growing 4x until the
    cut falls inside them: a full sort of a vocabulary costs far more than the few
    hundred tokens a nucleus usually holds."""
    probs = torch.softmax(x, dim=-1)  # (V,)
    v = probs.shape[0]
    k = min(TOP_P_FIRST, v)
    while True:
        top, order = torch.topk(probs, k)  # (k,) descending
        before = torch.cumsum(top, dim=0) - top  # mass ranked before each candidate
        if k == v or float(before[-1]) >= top_p:  # the last candidate is cut: all after it are too
            break
        k = min(4 * k, v)
    kept = order[before < top_p]  # the first always: nothing ranks before it, and top_p > 0
    out = torch.full_like(x, float("-inf"))
    out[kept] = x[kept]
    return out


def pick(weights: torch.Tensor, u: float) -> int:
    """The index a uniform ``u`` in [0, 1) selects from a (V,) row of nonnegative weights:
    the first whose running total exceeds u x the row's sum (inverse transform sampling),
    so index i is chosen with probability weights[i] / sum, and never one of weight 0.

    The running total is float64: its rounding (~V x 2^-53 of the sum) moves no token's
    probability measurably. One row at a time: a batch's totals would be a fresh
    allocation of megabytes, whose first touch costs more than the scans."""
    cdf = torch.cumsum(weights, dim=0, dtype=torch.float64)  # (V,)
    total = float(cdf[-1])
    if not 0 < total < math.inf:
        raise RuntimeError("probability tensor contains either inf or nan, or sums to 0")
    # u <= 1 - 2^-53, and that times any float64 total rounds to below the total:
    # some running total always exceeds it.
    return int(torch.searchsorted(cdf, torch.tensor(u * total, dtype=torch.float64), right=True))


def draw_token(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index of a (V,) row of nonnegative weights, with probability weight / sum, from
    one uniform of the row's generator: torch.multinomial would spend a random number on
    every entry, which over a vocabulary costs more than all the rest of a row's sampling."""
    return pick(weights, float(torch.rand((), dtype=torch.float64, generator=generator)))


def logprobs_of(logits: torch.Tensor, token_ids: Sequence[int], n: int) -> list[dict[int, Logprob]]:
    """Per row of raw (k, V) logits: {token_id: Logprob} of the given token
    first, then of the n most likely tokens (-1: all of them), as vLLM orders them.
    Ranks count the tokens strictly more likely, plus one."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    chosen = lp.gather(1, ids[:, None])  # (k, 1)
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    n = lp.shape[-1] if n == ALL_LOGPROBS else min(n, lp.shape[-1])
    top = torch.topk(lp, n, dim=-1) if n > 0 else None
    out = []
    for r, (t, v) in enumerate(zip(ids.tolist(), chosen[:, 0].tolist())):
        d = {t: Logprob(v, ranks[r])}
        if top is not None:
            for rank, (i, tv) in enumerate(zip(top.indices[r].tolist(), top.values[r].tolist()), start=1):
                if i not in d:
                    d[i] = Logprob(tv, rank)
        out.append(d)
    return out


def compute_logprobs(logits: torch.Tensor, token_id: int, n: int) -> dict[int, Logprob]:
    """{token_id: Logprob} of one (V,) row: the sampled token plus the top-n,
    from the raw logits (before processing, temperature and filters)."""
    return logprobs_of(logits[None], [token_id], n)[0]


class Sampler:
    """Samples one token per logits row, each with its request's parameters."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        histories: Sequence[TokenHistory] | None = None,
        want_logprob: Sequence[bool] | None = None,
    ) -> SamplerOutput:
        """logits: (S, V) float32, one row per request that samples this step.

        histories: each row's tokens, needed by rows whose params process logits.
        want_logprob: rows that need the sampled token's logprob even without
            params.logprobs (best_of ranks samples by it); they get {token: Logprob}.
        """
        s = logits.shape[0]
        if s == 0:
            return SamplerOutput([], [])
        greedy = [p.greedy for p in params]
        process = [p.processes_logits for p in params]
        if any(process) and histories is None:
            raise ValueError("logits processing (penalties, bias, masks) needs the rows' token histories")
        n_lp = [
            p.logprobs if p.logprobs is not None else (0 if want_logprob and want_logprob[i] else None)
            for i, p in enumerate(params)
        ]
        if all(greedy) and not any(process) and all(n is None for n in n_lp):
            # The common benchmark path: one argmax, no copy of the logits to the host.
            return SamplerOutput(torch.argmax(logits, dim=-1).tolist(), [None] * s)
        logits = logits.float().cpu()  # per-request CPU generators sample on the host
        tokens: list[int] = [0] * s
        plain_greedy = [i for i in range(s) if greedy[i] and not process[i]]
        if plain_greedy:
            arg = torch.argmax(logits[plain_greedy], dim=-1).tolist()
            for i, t in zip(plain_greedy, arg):
                tokens[i] = t
        drawn: list[int] = []  # the rows that draw, each as tempered and filtered logits
        rows: list[torch.Tensor] = []
        for i in range(s):
            if greedy[i] and not process[i]:
                continue
            x = logits[i]
            if process[i]:
                assert histories is not None  # checked above
                x = apply_logits_processing(x, params[i], histories[i])
            if greedy[i]:
                tokens[i] = int(torch.argmax(x))
            else:
                drawn.append(i)
                rows.append(apply_filters(x, params[i]))
        if drawn:  # one softmax for all of them: a row's probabilities are its own either way
            probs = torch.softmax(torch.stack(rows), dim=-1)  # (d, V)
            for i, row in zip(drawn, probs):
                tokens[i] = draw_token(row, generators[i])
        logprobs: list[dict[int, Logprob] | None] = [
            compute_logprobs(logits[i], tokens[i], n_lp[i]) if n_lp[i] is not None else None  # type: ignore[arg-type]
            for i in range(s)
        ]
        return SamplerOutput(tokens, logprobs)
