"""Executors: how rank 0's engine gets a step run on every rank.

``start_executor`` is the one place that chooses how the ranks run (as vLLM's
``Executor.get_class``):

- ``UniProcExecutor`` (uniproc.py): one rank, the model runner in this process;
- ``MultiRankExecutor`` (multiproc.py): P ranks, spawned here with
  torch.multiprocessing, or started by torchrun (its environment variables
  are set: every process runs the same program, rank 0 drives and the others
  serve inside ``start_executor`` until rank 0 shuts down).

Either way, what can be refused is refused first (preflight.py), and every
rank loads its model and sizes its KV cache through ``load_rank``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ctxpar.config import EngineConfig
from ctxpar.executor.preflight import check_launch
from ctxpar.executor.regroup import Regrouped
from ctxpar.worker.loading import RankModel
from ctxpar.worker.options import RunnerOptions
from ctxpar.worker.step_plan import StepOutput, StepPlan


class Executor(Protocol):
    rank_model: RankModel  # rank 0's model, tokenizer and KV-cache size
    runner_options: RunnerOptions  # rank 0's (every rank derives the same): the PCP policy among them

    def execute(self, plan: StepPlan) -> StepOutput:
        """The step's logits (and hidden states, where the plan asks for them), from rank 0."""
        ...

    def check_health(self) -> None:
        """Raise RankFailure if a rank is known to be lost (checked between steps)."""
        ...

    def recover_lost_ranks(self) -> Regrouped:
        """After a RankFailure: respawn the lost ranks (or go on without them) and form
        the group again (the survivors keep their KV caches). RankFailure if not possible."""
        ...

    def copy_kv(self, block_ids: np.ndarray) -> None:
        """Rank 0's KV of these blocks into every other rank's cache."""
        ...

    def rank_pids(self) -> list[int | None]:
        """Each rank's process id on this host, by rank (None: another host's, torchrun)."""
        ...

    def close(self, graceful: bool = True) -> None:
        """Stop the ranks (politely, unless after a failure) and release them."""
        ...


def start_executor(config: EngineConfig) -> Executor:
    """Check the launch, then start the ranks (each loads its model)."""
    check_launch(config)  # refused before minutes of loading are spent
    if config.pcp_size == 1:
        from ctxpar.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config)
    from ctxpar.executor.multiproc import MultiRankExecutor

    return MultiRankExecutor(config)
