"""SpecDecoder: the drafts of the requests about to decode, and the counters of what
their verification kept (the package's flow: ctxpar/engine/spec_decode/__init__.py)."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ctxpar.engine.request import Request
from ctxpar.engine.sample.rejection import Verified
from ctxpar.engine.spec_decode.draft import DraftModelProposer
from ctxpar.engine.spec_decode.mtp import MTPProposer
from ctxpar.engine.spec_decode.ngram import propose_ngram
from ctxpar.speculative_config import SpeculativeConfig
from ctxpar.worker.step_plan import StepOutput, StepPlan

# min_acceptance_rate: a request is judged over about this many recent drafts; below the
# rate it pauses drafting for PAUSE_STEPS of its decode steps, then tries again.
JUDGE_DRAFTS = 8
PAUSE_STEPS = 16


@dataclass
class SpecDecodeStats:
    """Totals since the engine started, as vLLM counts them."""

    num_drafts: int = 0  # verify rows (requests x steps with at least one draft)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts at position i accepted

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per verify row: the accepted drafts plus the one the target model adds."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


@dataclass
class _Judge:
    """One request's recent acceptance, for min_acceptance_rate."""

    drafted: int = 0
    accepted: int = 0
    paused: int = 0  # decode steps left without drafts


class SpecDecoder:
    """Drafts and their statistics for one engine (verification: engine/sample/rejection.py)."""

    def __init__(self, config: SpeculativeConfig, draft_model: DraftModelProposer | MTPProposer | None = None) -> None:
        """draft_model: the proposer of method "draft_model" or "mtp" (None for "ngram")."""
        self.config = config
        self.draft_model = draft_model
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._judges: weakref.WeakKeyDictionary[Request, _Judge] = weakref.WeakKeyDictionary()

    @classmethod
    def create(
        cls,
        config: SpeculativeConfig,
        draft_max_model_len: int | None,
        max_model_len: int,
        execute: Callable[[StepPlan], StepOutput],
        reserve: Callable[[Request, int], list[int] | None],
    ) -> SpecDecoder:
        """The decoder of ``config`` for an engine: n-gram lookup without a draft model
        (draft_max_model_len None), else the proposer of the draft model or the mtp layer,
        whose steps run through ``execute`` in the blocks ``reserve`` grows (the scheduler's)."""
        if draft_max_model_len is None:
            return cls(config)
        limit = min(draft_max_model_len, max_model_len)
        proposer = MTPProposer if config.method == "mtp" else DraftModelProposer
        return cls(config, proposer(config.num_speculative_tokens, limit, execute, reserve))

    def propose(self, running: Sequence[Request]) -> None:
        """Set ``spec_token_ids`` of the running requests, possibly to no drafts: only requests
        about to decode draft, and not constrained ones (their grammar advances one sampled
        token at a time)."""
        c = self.config
        drafting = [r for r in running if r.is_decode_ready and r.grammar is None and self._may_draft(r)]
        for r in running:
            r.spec_token_ids = []
        if self.draft_model is not None:
            self.draft_model.propose(drafting, running)  # the mtp layer catches every request up
            return
        if not drafting:
            return
        assert c.prompt_lookup_min is not None and c.prompt_lookup_max is not None  # set in __post_init__
        seqs = [r.prompt_token_ids + r.output_token_ids for r in drafting]
        drafts = propose_ngram(seqs, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max)
        for r, d in zip(drafting, drafts):
            r.spec_token_ids = d

    def _may_draft(self, req: Request) -> bool:
        if self.config.min_acceptance_rate <= 0:
            return True
        judge = self._judges.setdefault(req, _Judge())
        if judge.paused:
            judge.paused -= 1
            return False
        return True

    def with_hidden_rows(self, plan: StepPlan, requests: Sequence[Request]) -> StepPlan:
        """A target step's plan (row i: requests[i]), asking for the hidden states the mtp
        layer is fed: those of the rows of requests that may draft. Unchanged for the other
        methods."""
        if not isinstance(self.draft_model, MTPProposer):
            return plan
        return dataclasses.replace(plan, hidden_rows=np.array([r.grammar is None for r in requests]))

    def keep_hidden(self, requests: Sequence[Request], plan: StepPlan, hidden: torch.Tensor) -> None:
        """Hand the mtp layer a committed target step's hidden states (K, H) of its hidden_rows."""
        assert isinstance(self.draft_model, MTPProposer) and plan.hidden_rows is not None  # from with_hidden_rows
        at = 0
        for req, row, c, q in zip(requests, plan.hidden_rows, plan.num_computed_tokens, plan.num_scheduled_tokens):
            if row:
                self.draft_model.keep(req, int(c), hidden[at : at + q])
                at += q

    def draft_probs(self, req: Request) -> torch.Tensor | None:
        """The distributions (k, V) the request's drafts were drawn from; None: point masses."""
        return self.draft_model.probs.get(req) if self.draft_model is not None else None

    def record(self, verified: Sequence[Verified]) -> None:
        """Count a step's verify rows (the drafts each kept), for the engine and per request."""
        for v in verified:
            self._record(v.request, v.num_drafts, v.num_accepted)

    def _record(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        s, m = self.stats, req.metrics
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            s.accepted_per_pos[i] += 1
        m.num_drafts += 1
        m.num_draft_tokens += num_drafts
        m.num_accepted_tokens += num_accepted
        if self.config.min_acceptance_rate > 0:
            judge = self._judges.setdefault(req, _Judge())
            judge.drafted += num_drafts
            judge.accepted += num_accepted
            if judge.drafted >= JUDGE_DRAFTS:
                if judge.accepted < self.config.min_acceptance_rate * judge.drafted:
                    judge.paused = PAUSE_STEPS
                judge.drafted = judge.accepted = 0
