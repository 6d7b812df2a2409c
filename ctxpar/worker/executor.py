"""Executors: how rank 0's engine gets a step run on every rank.

``start_executor`` hides the number of ranks from the engine: with one rank
the model runner lives in this process; with more, rank 0 sends each plan to
the workers over the control plane and runs its own share.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ctxpar.config import EngineConfig
from ctxpar.worker.model_runner import ModelRunner
from ctxpar.worker.step_plan import StepPlan

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """float32 logits (S, vocab) of the rows with needs_logits, in row order."""
        ...

    def close(self) -> None: ...


def resolve_device(config: EngineConfig, local_rank: int = 0) -> torch.device:
    from ctxpar.errors import CtxparError

    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise CtxparError("device='cuda' was requested but no CUDA device is available; use device='cpu'")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


class LocalExecutor:
    """One rank, in this process."""

    def __init__(self, config: EngineConfig, loaded, num_blocks: int) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        device = next(loaded.model.parameters()).device
        self.runner = ModelRunner(loaded.model, num_blocks, config.block_size, device, DTYPES[config.dtype])

    def execute(self, plan: StepPlan) -> torch.Tensor:
        return self.runner.execute(plan)

    def close(self) -> None:
        self.runner = None


def start_executor(config: EngineConfig, loaded, num_blocks: int) -> Executor:
    if config.pcp_size == 1:
        return LocalExecutor(config, loaded, num_blocks)
    from ctxpar.parallel.launch import MultiRankExecutor

    return MultiRankExecutor(config, loaded, num_blocks)
