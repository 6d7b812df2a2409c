"""A rank's model runners: the target model's and, with speculative decoding's
draft_model, the draft model's. Each has its own KV cache, with the same number
and size of blocks, so one block table per request serves both; a StepPlan
names the model it runs on (``StepPlan.draft``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ctxpar.parallel.comm import PCPGroup
from ctxpar.worker.loading import RankModel
from ctxpar.worker.model_runner import ModelRunner
from ctxpar.worker.step_plan import StepOutput, StepPlan


class Runners:
    """Dispatches each plan to the runner of its model."""

    def __init__(self, target: ModelRunner, draft: ModelRunner | None = None) -> None:
        self.target = target
        self.draft = draft

    @classmethod
    def build(cls, rank_model: RankModel, make: Callable[[Any, bool], ModelRunner]) -> Runners:
        """``make(model, is_draft)``: this rank's runner of a model (the same options for both)."""
        draft = rank_model.draft
        return cls(make(rank_model.loaded.model, False), make(draft.model, True) if draft is not None else None)

    def execute(self, plan: StepPlan) -> StepOutput | None:
        """ModelRunner.execute on the plan's model."""
        if plan.draft:
            if self.draft is None:
                raise ValueError("a draft step, but this rank has no draft model")
            return self.draft.execute(plan)
        return self.target.execute(plan)

    def models(self) -> list[ModelRunner]:
        return [self.target] if self.draft is None else [self.target, self.draft]

    def copy_kv(self, block_ids: np.ndarray) -> None:
        """Rank 0's KV of these blocks into every other rank's cache, for each model."""
        for runner in self.models():
            runner.copy_blocks(block_ids)

    def rejoin(self, group: PCPGroup) -> None:
        """Run in a re-formed group (after a lost rank), caches kept."""
        for runner in self.models():
            runner.rejoin(group)
