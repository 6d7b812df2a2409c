"""The step the scheduler is planning: its rows, taken under the step's token budget,
and the requests preempted to make room for them; frozen into a ScheduledBatch once
every stage of ``Scheduler.schedule`` has had its turn."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ctxpar.engine.block_manager import BlockManager
from ctxpar.engine.request import Request
from ctxpar.engine.scheduled_batch import ScheduledBatch, build_plan


@dataclass
class BatchBuilder:
    """Rows in the order they were scheduled; ``budget`` is what is left of the tokens."""

    budget: int
    rows: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    _scheduled: set[str] = field(default_factory=set)

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
