"""One rank, in this process."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ctxpar.config import EngineConfig
from ctxpar.device import resolve_device
from ctxpar.errors import RankFailure
from ctxpar.executor.regroup import Regrouped
from ctxpar.layers.weight_arena import place_on_huge_pages
from ctxpar.worker.loading import load_rank
from ctxpar.worker.model_runner import ModelRunner
from ctxpar.worker.options import RunnerOptions
from ctxpar.worker.runners import Runners
from ctxpar.worker.step_plan import StepOutput, StepPlan


class UniProcExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.rank_model = load_rank(config, resolve_device(config.device))
        options = RunnerOptions.from_config(config, self.rank_model.num_blocks, self.rank_model.loaded.hf_config)
        self.runner_options = options
        device = self.rank_model.device

        def make(model: Any, is_draft: bool) -> ModelRunner:  # model: a loaded CausalLM module
            if not is_draft:
                place_on_huge_pages(model)  # see rank_worker.make_runner
            return ModelRunner(model, options, device)

        self.runner: Runners | None = Runners.build(self.rank_model, make)

    def execute(self, plan: StepPlan) -> StepOutput:
        assert self.runner is not None, "execute after close"
        out = self.runner.execute(plan)
        assert out is not None  # rank 0 always gets them
        return out

    def check_health(self) -> None:
        pass  # one rank, this process: nothing to lose that would not end the caller too

    def recover_lost_ranks(self) -> Regrouped:
        raise RankFailure("one rank in this process has no rank to lose")  # execute never raises RankFailure

    def rank_pids(self) -> list[int | None]:
        return [os.getpid()]

    def copy_kv(self, block_ids: np.ndarray) -> None:
        pass  # the only cache is rank 0's

    def close(self, graceful: bool = True) -> None:
        self.runner = None
