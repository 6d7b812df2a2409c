"""The step the scheduler is planning: its rows, taken under the step's token budget,
and the requests preempted to make room for them; frozen into a ScheduledBatch once
every stage of ``Scheduler.schedule`` has had its turn.

A prompt's last chunk may overrun the budget by an eighth of it (``chunk``): a few
tokens left over for the next step would hold the prompt's first token back by a whole
step, behind the next prompt's chunk. Decodes come first in a step, so a 512-token
prompt admitted beside 15 decodes under a 512-token budget would otherwise get 497 tokens
now and its first token only after the following step; a step stays within 9/8 of the
budget, so the decodes' wait stays bounded."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ctxpar.engine.block_manager import BlockManager
from ctxpar.engine.request import Request
from ctxpar.engine.scheduled_batch import ScheduledBatch, build_plan

TAIL_SLACK_DIVISOR = 8  # a prompt's last chunk may take budget // 8 tokens past the budget


@dataclass
class BatchBuilder:
    """Rows in the order they were scheduled; ``budget`` is what is left of the tokens
    (below 0 once a prompt's last chunk overran it: nothing more is taken)."""

    budget: int
    rows: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    _scheduled: set[str] = field(default_factory=set)
    slack: int = field(init=False)  # tokens past the budget that a prompt's last chunk may take

    def __post_init__(self) -> None:
        self.slack = self.budget // TAIL_SLACK_DIVISOR

    def chunk(self, remaining: int) -> int:
        """How many of a prompt's ``remaining`` tokens this step computes (asked while some
        budget is left): all of them when they overrun what is left of the budget by no more
        than ``slack``, else what is left."""
        return remaining if remaining <= self.budget + self.slack else self.budget

    def add(self, req: Request, num_tokens: int) -> None:
        """``req`` computes ``num_tokens`` from its num_computed_tokens on (its blocks allocated)."""
        self.rows.append((req, num_tokens))
        self._scheduled.add(req.request_id)
        self.budget -= num_tokens

    def has(self, req: Request) -> bool:
        return req.request_id in self._scheduled

    def build(self, block_manager: BlockManager) -> ScheduledBatch | None:
        """The batch of the rows taken, or None if there are none."""
        if not self.rows:
            return None
        now = time.perf_counter()
        for req, _ in self.rows:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
        return ScheduledBatch(build_plan(self.rows, block_manager), [r for r, _ in self.rows], self.preempted)
