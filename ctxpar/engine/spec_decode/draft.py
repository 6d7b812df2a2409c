"""Drafts from a smaller model with the same vocabulary (speculative_config method "draft_model").

The draft model runs in the same ranks as the target, through the same
executor, with its own paged KV cache at the same block ids: a request's block
table serves both models. Before a step, for each request about to decode:

1. catch-up: the draft computes the request's known tokens it has not seen
   (the whole prompt the first time, then the tokens accepted since), and
   draws the first draft from its logits of the last one;
2. k - 1 one-token steps, each feeding the previous draft.

Draft KV is kept only where it holds the request's known tokens: the drafts it
fed count only as far as the target accepted them (checked against the known
tokens at the next proposal, whatever steps ran in between), never past the
target's computed tokens (blocks past them may have been given back), and a
preempted request (its blocks freed) starts over. Drafts are drawn with the request's own sampling
settings and generator; greedy requests take the draft's argmax, sampled ones
keep the draft distribution q for the rejection sampler.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ctxpar.engine.request import Request
from ctxpar.engine.sample.rejection import drafted_history
from ctxpar.engine.sample.sampler import apply_filters, apply_logits_processing, draw_token
from ctxpar.worker.step_plan import StepOutput, StepPlan


@dataclass
class _DraftKV:
    computed: int = 0  # the request's first positions whose draft KV is in the cache
    preemptions: int = 0  # the request's preemptions when it was computed
    drafts_from: int = 0  # positions from here on were fed drafts, not known tokens
    drafts: list[int] = field(default_factory=list)  # the drafts fed there


class DraftModelProposer:
    """Runs the draft model's steps and draws the drafts."""

    def __init__(
        self,
        num_speculative_tokens: int,
        max_model_len: int,
        execute: Callable[[StepPlan], StepOutput],
        reserve: Callable[[Request, int], list[int] | None],
    ) -> None:
        """max_model_len: the draft's context limit; execute: runs a plan on every rank and
        returns rank 0's outputs; reserve(req, n): the request's block table grown to cover n
        tokens (no preemption), or None when the free blocks do not allow it."""
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.execute = execute
        self.reserve = reserve
        self._kv: weakref.WeakKeyDictionary[Request, _DraftKV] = weakref.WeakKeyDictionary()
        self.probs: weakref.WeakKeyDictionary[Request, torch.Tensor] = weakref.WeakKeyDictionary()

    def propose(self, requests: Sequence[Request], running: Sequence[Request] = ()) -> None:
        """Set each request's ``spec_token_ids`` (and, for sampled ones, ``probs``: (k, V)).
        running: unused (the draft model catches a request up when it drafts for it)."""
        todo: list[tuple[Request, int, list[int]]] = []  # (request, drafts wanted, block table)
        for req in requests:
            req.spec_token_ids = []
            self.probs.pop(req, None)
            k = min(self.k, req.max_total_tokens - req.num_tokens - 1, self.max_model_len - req.num_tokens)
            table = self.reserve(req, req.num_tokens + k) if k > 0 else None
            if table is not None:
                todo.append((req, k, table))
        if not todo:
            return
        rows = [(req, self._start(req), table) for req, _, table in todo]
        for step in range(max(k for _, k, _ in todo)):
            active = [(row, k) for row, (_, k, _) in zip(rows, todo) if k > step]
            plan_rows = []
            for (req, start, table), _ in active:
                ids = req.token_ids(start, req.num_tokens) if step == 0 else [req.spec_token_ids[-1]]
                c = start if step == 0 else req.num_tokens + step - 1
                plan_rows.append((req, c, ids, table))
            logits = self.execute(draft_plan(plan_rows)).logits  # (R, V)
            for (req, c, ids, _), row in zip(plan_rows, logits):
                kv = self._kv[req]
                kv.computed = c + len(ids)
                if step == 0:
                    kv.drafts_from, kv.drafts = kv.computed, []
                else:
                    kv.drafts.append(ids[0])
                req.spec_token_ids.append(draw(req, row, self.probs))

    def _start(self, req: Request) -> int:
        """Where the request's catch-up starts: the end of its known tokens with draft KV."""
        kv = self._kv.setdefault(req, _DraftKV(preemptions=req.num_preemptions))
        if kv.preemptions != req.num_preemptions:  # its blocks were freed
            kv.computed, kv.preemptions, kv.drafts = 0, req.num_preemptions, []
        # The fed drafts hold KV of known tokens as far as they agree with them.
        known = req.token_ids(kv.drafts_from, min(req.num_tokens, kv.drafts_from + len(kv.drafts)))
        agree = next((i for i, (d, t) in enumerate(zip(kv.drafts, known)) if d != t), len(known))
        kv.computed = min(kv.computed, kv.drafts_from + agree, req.num_computed_tokens, req.num_tokens - 1)
        return kv.computed


def draw(req: Request, logits: torch.Tensor, probs: weakref.WeakKeyDictionary[Request, torch.Tensor]) -> int:
    """The request's next draft from a draft model's (V,) logits, by its sampling settings;
    for a sampled request the draft distribution q is appended to ``probs[req]`` ((j, V))."""
    p = req.params
    if p.greedy and not p.processes_logits:
        return int(torch.argmax(logits))
    x = logits.float().cpu()  # the request's CPU generator draws on the host (as the Sampler's rows)
    if p.processes_logits:
        x = apply_logits_processing(x, p, drafted_history(req, req.spec_token_ids))
    if p.greedy:
        return int(torch.argmax(x))
    q = torch.softmax(apply_filters(x, p), dim=-1)  # (V,)
    token = draw_token(q, req.generator)
    previous = probs.get(req)
    probs[req] = q[None] if previous is None else torch.cat([previous, q[None]])
    return token


def draft_plan(
    rows: list[tuple[Request, int, list[int], list[int]]],
    needs_logits: np.ndarray | None = None,
    hidden_states: torch.Tensor | None = None,
) -> StepPlan:
    """A draft step: per row (request, tokens cached before, tokens to feed, block table);
    needs_logits (R,) bool (default: every row), hidden_states (T, H) for the mtp layer,
    which also returns its output states of every token of the rows with logits."""
    q = np.array([len(ids) for _, _, ids, _ in rows], dtype=np.int64)
    c = np.array([c for _, c, _, _ in rows], dtype=np.int64)
    prompt = np.array([req.num_prompt_tokens for req, _, _, _ in rows], dtype=np.int64)
    needs_logits = needs_logits if needs_logits is not None else np.ones(len(rows), dtype=bool)
    return StepPlan(
        input_ids=np.array([t for _, _, ids, _ in rows for t in ids], dtype=np.int64),
        num_scheduled_tokens=q,
        num_computed_tokens=c,
        is_prefilling=(q > 1) | (c < prompt),  # a one-token row past the prompt is laid out as a decode
        num_prompt_tokens=prompt,
        needs_logits=needs_logits,
        block_tables=[np.asarray(table, dtype=np.int64) for _, _, _, table in rows],
        draft=True,
        hidden_rows=needs_logits if hidden_states is not None else None,
        hidden_states=hidden_states,
    )
