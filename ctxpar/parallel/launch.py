"""Starting, driving and stopping PCP ranks.

Rank 0 (the caller's process) runs the engine and its own model runner. The
other ranks are either spawned here with torch.multiprocessing, or started by
torchrun (the torch.distributed environment variables are set): then every
process runs the same program, rank 0 drives and the others serve in
``MultiRankExecutor.__init__`` until rank 0 shuts down, and then exit.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback

import torch
import torch.multiprocessing as mp

from ctxpar.config import EngineConfig
from ctxpar.errors import CtxparError
from ctxpar.parallel.comm import DATA_TIMEOUT_S, PCPGroup, torchrun_env
from ctxpar.worker.model_runner import ModelRunner
from ctxpar.worker.step_plan import StepPlan


class RankFailure(RuntimeError):
    """A PCP rank died or failed: the engine cannot continue."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def threads_per_rank(config: EngineConfig) -> int:
    return config.num_threads or max(1, (os.cpu_count() or 1) // config.pcp_size)


def _make_runner(config: EngineConfig, model, num_blocks: int, group: PCPGroup) -> ModelRunner:
    from ctxpar.worker.executor import DTYPES

    return ModelRunner(
        model, num_blocks, config.block_size, group.device, DTYPES[config.dtype], group, config.pcp_min_tokens
    )


def _serve(runner: ModelRunner, group: PCPGroup) -> None:
    """A worker's whole life: run every plan rank 0 sends, until it sends None."""
    while (plan := group.broadcast_object()) is not None:
        runner.execute(plan)


def _worker_main(config: EngineConfig, rank: int, init_method: str, num_blocks: int) -> None:
    from ctxpar.models.loader import load_model
    from ctxpar.worker.executor import DTYPES, resolve_device

    try:
        torch.set_num_threads(threads_per_rank(config))
        device = resolve_device(config, rank)
        group = PCPGroup(rank, config.pcp_size, device, init_method)
        loaded = load_model(config.model, DTYPES[config.dtype], device, config.max_model_len)
        runner = _make_runner(config, loaded.model, num_blocks, group)
        group.barrier()  # model loaded
        _serve(runner, group)
        group.close()
    except Exception:
        print(f"ctxpar: PCP rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(1)


class MultiRankExecutor:
    """Rank 0's handle on all PCP ranks: execute(plan) runs the step everywhere."""

    def __init__(self, config: EngineConfig, loaded, num_blocks: int) -> None:
        from ctxpar.worker.executor import resolve_device

        self.procs: list[mp.Process] = []
        self.group: PCPGroup | None = None
        env = torchrun_env()
        if env is not None:
            rank, world, local_rank, init_method = env
            if world != config.pcp_size:
                raise CtxparError(f"torchrun started {world} processes but pcp_size={config.pcp_size}; make them equal")
        else:
            rank, local_rank = 0, 0
            init_method = f"tcp://{config.master_addr}:{config.master_port or free_port()}"
        device = resolve_device(config, local_rank)
        if device.type == "cuda" and env is None and config.pcp_size > torch.cuda.device_count():
            raise CtxparError(
                f"pcp_size={config.pcp_size} needs one GPU per rank but {torch.cuda.device_count()} are visible"
            )
        torch.set_num_threads(threads_per_rank(config))
        if env is None:
            spawn = mp.get_context("spawn")
            for r in range(1, config.pcp_size):
                p = spawn.Process(target=_worker_main, args=(config, r, init_method, num_blocks), daemon=True)
                p.start()
                self.procs.append(p)
        try:
            self.group = PCPGroup(rank, config.pcp_size, device, init_method)
            self.runner = _make_runner(config, loaded.model, num_blocks, self.group)
            if rank != 0:  # torchrun worker: serve, then leave with the rest of the program
                self.group.barrier()
                _serve(self.runner, self.group)
                self.group.close()
                sys.exit(0)
            self.group.barrier()  # returns once every worker has loaded its model
        except Exception as e:
            self.close(graceful=False)
            raise RankFailure(f"starting {config.pcp_size} PCP ranks failed: {self._why(e)}") from e

    # Why the ranks were stopped, once execute has stopped them; None while they run.
    _stopped_because: str | None = None

    def execute(self, plan: StepPlan) -> torch.Tensor:
        if self.group is None:
            why = self._stopped_because or "they were shut down after an earlier failure"
            raise RankFailure(f"the PCP ranks were stopped: {why}; create a new LLM")
        self._check_alive()
        try:
            self.group.broadcast_object(plan)
            return self.runner.execute(plan)
        except Exception as e:
            why = self._why(e)
            self._stopped_because = f"a rank failed during a step ({why})"
            self.close(graceful=False)
            raise RankFailure(f"a PCP rank failed during a step: {why}") from e
        except BaseException as e:
            # KeyboardInterrupt (or SystemExit) on rank 0 mid-step: the other ranks are
            # inside this step's collectives and cannot be led out of them, so stop them
            # now, and let the interrupt through.
            self._stopped_because = f"a step was interrupted ({type(e).__name__})"
            self.close(graceful=False)
            raise

    def _check_alive(self) -> None:
        dead = [(i + 1, p.exitcode) for i, p in enumerate(self.procs) if not p.is_alive()]
        if dead:
            self.close(graceful=False)
            raise RankFailure(", ".join(f"PCP rank {r} exited with code {c}" for r, c in dead))

    def _why(self, e: Exception) -> str:
        dead = [f"rank {i + 1} exited with code {p.exitcode}" for i, p in enumerate(self.procs) if not p.is_alive()]
        cause = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return "; ".join(dead) + f" ({cause})" if dead else f"{cause} (no rank answered within {DATA_TIMEOUT_S} s?)"

    def close(self, graceful: bool = True) -> None:
        """Stop the workers (politely unless after a failure, then by force)
        and leave the process group. Idempotent."""
        group, self.group = self.group, None
        if graceful and group is not None and all(p.is_alive() for p in self.procs):
            try:
                group.broadcast_object(None)
            except Exception:
                pass  # a broken group: the workers are terminated below
        for p in self.procs:
            p.join(timeout=5 if graceful else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs = []
        if group is not None:
            group.close()

    def __del__(self) -> None:
        self.close()
