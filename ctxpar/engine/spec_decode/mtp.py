"""Drafts from a DeepSeek-V3 checkpoint's multi-token-prediction layer (speculative_config
method "mtp"; the layer is models/deepseek_mtp.py).

The layer's KV at position i is computed from (the target's hidden state h_i, the
token t_{i+1}), so it can be computed only once the target has computed position i
and token i + 1 is known. Each target step therefore returns the final hidden
states of every token it computed (``StepPlan.hidden_rows``), ``keep`` holds them,
and before the next step one draft step catches every running request's layer KV
up to the target's (prefill chunks included, so the states are held for one step
only). For each request about to decode, whose known tokens are t_0 .. t_{n-1}
and whose target KV covers positions 0 .. n-2:

    catch-up  positions up to n-2, fed (h_i, t_{i+1})  -> logits at n-2 -> draft d_1, state g
    then      position n-2+j, fed (g, d_j)              -> draft d_{j+1}, new g   (j = 1 .. k-1)

Positions fed the layer's own state g hold approximate KV: they are never kept
(the next catch-up writes them again from the target's states). A preempted
request (its blocks freed) starts over as its prompt is computed again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ctxpar.engine.request import Request
from ctxpar.engine.spec_decode.draft import draft_plan, draw
from ctxpar.worker.step_plan import StepOutput, StepPlan


@dataclass
class _LayerKV:
    computed: int = 0  # positions 0 .. computed - 1 hold the request's layer KV
    preemptions: int = 0  # the request's preemptions when it was computed
    start: int = 0  # the position of hidden[0]
    hidden: torch.Tensor | None = None  # (m, H) the target's states of positions start .. start + m - 1


class MTPProposer:
    """Keeps the target's hidden states, runs the layer's steps and draws the drafts."""

    def __init__(
        self,
        num_speculative_tokens: int,
        max_model_len: int,
        execute: Callable[[StepPlan], StepOutput],
        reserve: Callable[[Request, int], list[int] | None],
    ) -> None:
        """As DraftModelProposer's: the context limit, the executor's run, the scheduler's reserve."""
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.execute = execute
        self.reserve = reserve
        self._kv: weakref.WeakKeyDictionary[Request, _LayerKV] = weakref.WeakKeyDictionary()
        self.probs: weakref.WeakKeyDictionary[Request, torch.Tensor] = weakref.WeakKeyDictionary()

    def keep(self, req: Request, start: int, hidden: torch.Tensor) -> None:
        """The target's final hidden states (q, H) of positions start .. start + q - 1 (a step's row)."""
        kv = self._kv.setdefault(req, _LayerKV(preemptions=req.num_preemptions))
        if kv.hidden is not None and kv.start <= start <= kv.start + len(kv.hidden):
            hidden = torch.cat([kv.hidden[: start - kv.start], hidden])  # after a rollback: rows past start go
            start = kv.start
        kv.start, kv.hidden = start, hidden

    def propose(self, drafting: Sequence[Request], running: Sequence[Request]) -> None:
        """Catch every running request's layer KV up; set the drafting ones' ``spec_token_ids``
        (and, for sampled ones, ``probs``: (k, V))."""
        rows: list[tuple[Request, int, list[int], list[int]]] = []  # (request, cached, ids, block table)
        states, wants = [], []  # per row: the target's states (q, H); drafts wanted
        drafts = {id(r) for r in drafting}
        for req in running:
            kv = self._kv.get(req)
            if kv is None or kv.hidden is None:
                continue  # computed nothing since the last catch-up
            if kv.preemptions != req.num_preemptions:  # its blocks were freed: start over
                kv.computed, kv.preemptions = 0, req.num_preemptions
            end = req.num_computed_tokens  # token end is known for every position below
            k = 0
            if id(req) in drafts:
                k = min(self.k, req.max_total_tokens - req.num_tokens - 1, self.max_model_len - req.num_tokens)
            # A drafter needs its last position's logits, even when that position is caught up already.
            first = max(min(kv.computed, end - 1 if k > 0 else end), kv.start)
            table = self.reserve(req, req.num_tokens + k if k > 0 else end)
            if table is None:  # no room for the drafts' KV: catch up only
                k, table = 0, self.reserve(req, end)
                first = max(min(kv.computed, end), kv.start)
            assert table is not None  # the positions below end are allocated
            if first >= end:
                continue
            rows.append((req, first, req.token_ids(first + 1, end + 1), table))
            states.append(kv.hidden[first - kv.start : end - kv.start])
            wants.append(k)
        for req in drafting:
            req.spec_token_ids = []
            self.probs.pop(req, None)
        if not rows:
            return
        needs = np.array([k > 0 for k in wants])
        out = self.execute(draft_plan(rows, needs, torch.cat(states)))
        for req, first, ids, _ in rows:
            kv = self._kv[req]
            end = first + len(ids)
            kv.computed = end
            assert kv.hidden is not None  # rows are built from held states
            kv.hidden, kv.start = kv.hidden[end - 1 - kv.start :], end - 1  # the last is the next drafter's
        drafters = [(row, k) for row, k in zip(rows, wants) if k > 0]
        if drafters:
            self._chain(drafters, out)

    def _chain(self, drafters: list[tuple[tuple[Request, int, list[int], list[int]], int]], out: StepOutput) -> None:
        """Draw each drafter's first draft from the catch-up's logits, then k - 1 one-token steps."""
        assert out.hidden is not None  # the plan asked for the drafters' states
        lengths = [len(ids) for (_, _, ids, _), _ in drafters]
        g = out.hidden[np.cumsum(lengths) - 1]  # (D, H) each drafter's state at its last position
        tables = [table for (_, _, _, table), _ in drafters]
        reqs = [req for (req, _, _, _), _ in drafters]
        for req, row in zip(reqs, out.logits):
            req.spec_token_ids.append(draw(req, row, self.probs))
        for step in range(1, max(k for _, k in drafters)):
            active = [i for i, (_, k) in enumerate(drafters) if k > step]
            # Position n - 2 + step, fed the draft just drawn and the layer's own last state.
            plan_rows = [
                (reqs[i], reqs[i].num_tokens - 2 + step, [reqs[i].spec_token_ids[-1]], tables[i]) for i in active
            ]
            out = self.execute(draft_plan(plan_rows, np.ones(len(active), dtype=bool), g[active]))
            assert out.hidden is not None  # every row has logits, so its state comes back
            g = g.clone()
            g[active] = out.hidden
            for i, row in zip(active, out.logits):
                reqs[i].spec_token_ids.append(draw(reqs[i], row, self.probs))
