"""Token sampling: greedy, temperature, top-k, top-p, min-p, and logprobs.

Each row is sampled on its own with its request's ``torch.Generator``, so a
seeded request draws the same tokens whatever else shares its batch. Greedy
rows (temperature 0) are one vectorised argmax. Logits arrive in float32 and
only for rows that sample (the executor computes no others).

Order of the filters, as in vLLM: temperature, then min-p (relative to the
most likely token of the tempered distribution), then top-k, then top-p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ctxpar.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row; None where not requested


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
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep a token if the mass of the tokens strictly more likely than it
        # is still below top_p: the smallest set that reaches top_p. The most
        # likely token always survives.
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = before >= params.top_p
        drop_sorted[0] = False
        drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Draw one token from a row's (V,) float32 logits."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(apply_filters(logits, params), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def compute_logprobs(logits: torch.Tensor, token_id: int, n: int) -> dict[int, float]:
    """{token_id: logprob} for the top-n tokens plus the sampled one, from the
    raw logits (before temperature and filters), as vLLM reports them."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out: dict[int, float] = {}
    if n > 0:
        top = torch.topk(lp, min(n, lp.shape[-1]))
        out = {int(i): float(v) for i, v in zip(top.indices.tolist(), top.values.tolist())}
    out[token_id] = float(lp[token_id])
    return out


class Sampler:
    """Samples one token per logits row, each with its request's parameters."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> SamplerOutput:
        """logits: (S, V) float32, one row per request that samples this step."""
        s = logits.shape[0]
        if s == 0:
            return SamplerOutput([], [])
        greedy = [p.greedy for p in params]
        want_lp = [p.logprobs is not None for p in params]
        if all(greedy) and not any(want_lp):
            # The common benchmark path: one argmax, no copy of the logits to the host.
            return SamplerOutput(torch.argmax(logits, dim=-1).tolist(), [None] * s)
        logits = logits.float().cpu()  # per-request CPU generators sample on the host
        tokens: list[int] = [0] * s
        greedy_rows = [i for i in range(s) if greedy[i]]
        if greedy_rows:
            arg = torch.argmax(logits[greedy_rows], dim=-1).tolist()
            for i, t in zip(greedy_rows, arg):
                tokens[i] = t
        for i in range(s):
            if not greedy[i]:
                tokens[i] = sample_row(logits[i], params[i], generators[i])
        logprobs: list[dict[int, float] | None] = [
            compute_logprobs(logits[i], tokens[i], params[i].logprobs) if want_lp[i] else None  # type: ignore[arg-type]
            for i in range(s)
        ]
        return SamplerOutput(tokens, logprobs)
