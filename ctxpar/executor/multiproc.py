"""Starting, driving and stopping P ranks (ctxpar/executor/__init__.py chooses this executor).

Rank 0 (the caller's process) runs the engine and its own model runner. The
other ranks are either spawned here with torch.multiprocessing, or started by
torchrun (the torch.distributed environment variables are set): then every
process runs the same program, rank 0 drives and the others serve in
``MultiRankExecutor.__init__`` until rank 0 shuts down, and then exit.

Ranks meet through the handshake of startup.py; spawned workers ignore
SIGINT (a terminal's Ctrl-C reaches the whole process group): their lifetime
is rank 0's to decide, and rank 0 stops them when it is interrupted.
"""

from __future__ import annotations

import itertools
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from multiprocessing.process import BaseProcess
from typing import Any, cast

import numpy as np
import torch.distributed as dist
import torch.multiprocessing as mp

from ctxpar.config import EngineConfig
from ctxpar.device import resolve_device
from ctxpar.errors import RankFailure, RanksStopped
from ctxpar.executor import recovery, startup
from ctxpar.executor.shared_weights import share_weights
from ctxpar.parallel.comm import (
    STARTUP_TIMEOUT_S,
    PCPGroup,
    TorchrunEnv,
    data_timeout_s,
    open_store,
    torchrun_env,
)
from ctxpar.parallel.shm_channel import PeerLost
from ctxpar.worker.loading import RankModel, load_rank
from ctxpar.worker.model_runner import ModelRunner
from ctxpar.worker.options import RunnerOptions
from ctxpar.worker.runners import Runners
from ctxpar.worker.step_plan import KVCopy, StepOutput, StepPlan

__all__ = ["MultiRankExecutor", "RankFailure", "free_port"]

# Each executor's handshake keys get their own prefix: under torchrun the
# agent's store outlives an LLM, and every process creates its LLMs in the
# same order, so the n-th LLM of every rank meets under "ctxpar/n/".
_executor_serial = itertools.count()

EXIT_GRACE_S = 1.0  # after a failed collective, how long to wait for a dying worker's exit code


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _make_runner(config: EngineConfig, rank_model: RankModel, group: PCPGroup, share: bool = True) -> Runners:
    """share: map the host's one copy of the weights (every rank at start-up; a rank
    respawned after a failure keeps its own copy, the others having shared theirs)."""
    options = RunnerOptions.from_config(
        config, rank_model.num_blocks, rank_model.loaded.hf_config, one_host=group.one_host
    )

    def make(model: Any, is_draft: bool) -> ModelRunner:  # model: a loaded CausalLM module
        if group.one_host and share:  # one copy per host instead of one per rank
            share_weights(model, group, "draft_weights" if is_draft else "weights")
        return ModelRunner(model, options, group.device, group)

    return Runners.build(rank_model, make)


def _join(
    config: EngineConfig, store: dist.Store, rank: int, rank_model: RankModel, share: bool = True
) -> tuple[PCPGroup, Runners]:
    """A worker with its model loaded: handshake, then (group, runner); share: see _make_runner."""
    startup.follow(store, rank, time.monotonic() + STARTUP_TIMEOUT_S)
    group = PCPGroup(rank, config.pcp_size, rank_model.device, store)
    return group, _make_runner(config, rank_model, group, share)


def _serve(runner: Runners, group: PCPGroup) -> None:
    """Run every message rank 0 sends (step plans, KV copies), until it sends None.

    Raises RankFailure when a link fails: rank 0 or a peer went away (its
    sockets close, or its process is seen dead), or rank 0 left the group to
    recover from a lost rank; the wait for the next plan, or a collective of
    the step under way, then fails at once.
    """
    while True:
        try:
            msg = group.broadcast_object()
            if msg is None:
                return
            if isinstance(msg, KVCopy):
                runner.copy_kv(msg.block_ids)
            else:
                runner.execute(cast(StepPlan, msg))
        except Exception as e:
            if not _is_link_failure(e):
                raise  # this rank's own failure: the caller shows the traceback
            raise RankFailure(f"PCP rank {group.rank} lost rank 0 or a peer ({startup.first_line(e)})") from e


def _serve_until_stopped(
    config: EngineConfig, store: dist.Store, runner: Runners, group: PCPGroup, generation: int
) -> None:
    """A spawned worker's life: serve; when the group breaks, wait for rank 0 to
    re-form it (a lost rank respawned) and serve on, keeping this rank's KV cache.
    Raises RankFailure when rank 0 is gone or gives up."""
    while True:
        try:
            _serve(runner, group)
            group.close()
            return
        except RankFailure:
            group.close()
            generation += 1
            recovery.await_recovery(store, generation, group.rank)  # RankFailure: rank 0 is gone or gave up
            gstore = recovery.generation_store(store, generation)
            startup.follow(gstore, group.rank, time.monotonic() + STARTUP_TIMEOUT_S)
            group = PCPGroup(group.rank, config.pcp_size, group.device, gstore)
            runner.rejoin(group)


def _is_link_failure(e: Exception) -> bool:
    # gloo's transport errors surface as plain RuntimeErrors naming the transport.
    return isinstance(e, (dist.DistError, PeerLost)) or "gloo/transport" in str(e)


def _worker_main(config: EngineConfig, rank: int, addr: str, port: int, prefix: str, generation: int) -> None:
    """Entry point of a spawned rank. generation: 0 at start-up; g for a rank respawned
    by rank 0's g-th recovery (it meets the others under that generation's keys)."""
    # Started with SIGINT blocked (see _spawn): ignore it, then unblock.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    store = gstore = None
    try:
        store = dist.PrefixStore(prefix, open_store(addr, port, is_master=False))
        gstore = recovery.generation_store(store, generation)
        gstore.set(f"started/{rank}", "")
        rank_model = load_rank(config, resolve_device(config.device, rank))
        group, runner = _join(config, gstore, rank, rank_model, share=generation == 0)
    except Exception as e:
        startup.report_failure(gstore, rank, e)
        if not isinstance(e, RankFailure):  # rank 0 gave up: it tells the user why
            print(f"ctxpar: PCP rank {rank} failed to start:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(1)
    try:
        _serve_until_stopped(config, store, runner, group, generation)
    except RankFailure as e:  # rank 0 is gone: nothing to add to what it reports
        print(f"ctxpar: {e}; exiting", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception:
        print(f"ctxpar: PCP rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(1)


class MultiRankExecutor:
    """Rank 0's handle on all PCP ranks: execute(plan) runs the step everywhere."""

    def __init__(self, config: EngineConfig) -> None:
        """Load rank 0's model, then start the other ranks (spawned, or met
        under torchrun, where a non-zero rank serves here and never returns).
        The caller has run preflight.check_launch."""
        self.config = config
        self.procs: list[BaseProcess] = []  # rank r's process at index r - 1 (spawned ranks)
        self.group: PCPGroup | None = None
        self.store: dist.Store | None = None
        self._server: dist.TCPStore | None = None
        self._port = 0  # of rank 0's store, which respawned ranks join (spawned ranks only)
        self._generation = 0  # recoveries so far: ranks meet under recovery.generation_store
        env = torchrun_env()
        rank = env.rank if env is not None else 0
        self.rank_model = load_rank(config, resolve_device(config.device, env.local_rank if env is not None else 0))
        self._prefix = f"ctxpar/{next(_executor_serial)}/"
        if env is not None:
            self.store = dist.PrefixStore(self._prefix, _torchrun_store(env))
            if rank != 0:
                self._serve_torchrun_worker(config, rank)  # never returns
        else:
            # port 0: the store binds a free port itself (no race with other jobs).
            self._server = open_store(config.master_addr, config.master_port or 0, is_master=True)
            self._port = self._server.port
            self.store = dist.PrefixStore(self._prefix, self._server)
        try:
            if env is None:
                self._spawn(range(1, config.pcp_size))
            self._form_group(fresh=True)
        except BaseException as e:  # KeyboardInterrupt included: never leave workers behind
            startup.abandon(self.store, startup.first_line(e))
            why = self._why(e) if isinstance(e, Exception) else ""  # before close() forgets the processes
            self.close(graceful=False)
            if isinstance(e, RankFailure) or not isinstance(e, Exception):
                raise
            raise RankFailure(f"starting {config.pcp_size} PCP ranks failed: {why}") from e

    def _form_group(self, fresh: bool) -> None:
        """Meet every rank under this generation's keys and form the group; a fresh
        runner at start-up, rank 0's own runner (and KV cache) kept after a recovery."""
        assert self.store is not None  # set in __init__
        store = recovery.generation_store(self.store, self._generation)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        startup.lead(store, self.config.pcp_size, dict(enumerate(self.procs, start=1)), deadline)
        self.group = PCPGroup(0, self.config.pcp_size, self.rank_model.device, store)
        if fresh:
            self.runner = _make_runner(self.config, self.rank_model, self.group)
            self.runner_options = self.runner.target.options
        else:
            self.runner.rejoin(self.group)

    def _spawn(self, ranks: Iterable[int]) -> None:
        ctx = mp.get_context("spawn")
        # The children inherit this thread's signal mask: with SIGINT blocked
        # while they start, a Ctrl-C during their imports cannot make them
        # print a traceback; _worker_main ignores SIGINT and unblocks it.
        # (Rank 0 still gets the Ctrl-C: its other threads take it.)
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            for r in ranks:
                args = (self.config, r, self.config.master_addr, self._port, self._prefix, self._generation)
                p = ctx.Process(target=_worker_main, args=args, daemon=True)
                p.start()
                if r <= len(self.procs):
                    self.procs[r - 1] = p  # a respawned rank
                else:
                    self.procs.append(p)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def _serve_torchrun_worker(self, config: EngineConfig, rank: int) -> None:
        """A non-zero torchrun rank: serve rank 0, then leave with the rest of
        the program (or raise RankFailure if rank 0 goes away)."""
        assert self.store is not None  # __init__ joined the store first
        try:
            self.group, self.runner = _join(config, self.store, rank, self.rank_model)
        except Exception as e:
            startup.report_failure(self.store, rank, e)
            raise
        _serve(self.runner, self.group)
        self.group.close()
        sys.exit(0)

    # Why the ranks were stopped, once execute has stopped them; None while they run.
    _stopped_because: str | None = None

    def execute(self, plan: StepPlan) -> StepOutput:
        out = self._lead(plan, self.runner.execute)
        assert out is not None  # rank 0 always gets them
        return out

    def copy_kv(self, block_ids: np.ndarray) -> None:
        """Rank 0's KV (every model's cache) of these blocks into every other rank's:
        restores a respawned rank's cache where each rank holds the whole cache."""
        self._lead(KVCopy(block_ids), lambda msg: self.runner.copy_kv(msg.block_ids))

    def _lead(self, msg: Any, run: Callable[[Any], Any]) -> Any:
        """Send ``msg`` to every rank and run it here too."""
        if self.group is None:
            why = self._stopped_because or "they were shut down after an earlier failure"
            if not self.procs:  # closed: nothing left to recover
                raise RanksStopped(f"the PCP ranks were stopped: {why}; create a new LLM")
            raise RankFailure(f"the PCP ranks were stopped: {why}")
        self._check_alive()
        try:
            self.group.broadcast_object(msg)
            return run(msg)
        except Exception as e:
            why = self._why(e)
            self._leave(f"a rank failed during a step ({why})")
            raise RankFailure(f"a PCP rank failed during a step: {why}") from e
        except BaseException as e:
            # KeyboardInterrupt (or SystemExit) on rank 0 mid-step: the other ranks are
            # inside this step's collectives and cannot be led out of them, so stop them
            # now, and let the interrupt through.
            self._stopped_because = f"a step was interrupted ({type(e).__name__})"
            self.close(graceful=False)
            raise

    def check_health(self) -> None:
        """Raise RankFailure if a spawned rank has exited (an idle engine runs no
        collective that would fail). Ranks under torchrun are other programs'
        processes: their loss shows at the next step."""
        if self.group is not None:
            self._check_alive()

    def restart_lost_ranks(self) -> list[int]:
        """After a RankFailure: respawn the ranks that died and form the group again
        with the survivors, which kept their KV caches. Returns the respawned ranks
        (their caches are empty: the caller restores them). Raises RankFailure when
        that cannot be done: ranks under torchrun, a rank that hung instead of dying,
        or a respawned rank that fails to start."""
        if self._port == 0:
            raise RankFailure("a rank under torchrun cannot be respawned by ctxpar; restart the job")
        self._leave(self._stopped_because or "a rank was lost")
        lost = self._lost_ranks()
        if not lost:
            raise RankFailure("no rank died: a rank that hangs, or fails by itself, is not replaced")
        self._generation += 1
        self._spawn(lost)
        assert self.store is not None  # spawned ranks: rank 0 hosts it
        recovery.announce(self.store, self._generation)  # the survivors join this generation too
        try:
            self._form_group(fresh=False)
        except Exception as e:
            why = self._why(e)
            self._leave(f"recovering from a lost rank failed ({why})")
            raise RankFailure(f"respawning PCP rank(s) {lost} failed: {why}") from e
        self._stopped_because = None
        return lost

    def _lost_ranks(self) -> list[int]:
        self._await_exits()
        return [r for r, _ in self._dead()]

    def _await_exits(self) -> None:
        """Give the workers a moment to be seen dead: a peer's closed socket can fail a
        collective before its process is reaped."""
        deadline = time.monotonic() + EXIT_GRACE_S
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))

    def _leave(self, why: str) -> None:
        """Leave the broken group, keeping the surviving ranks (they wait for a
        recovery, or for close() to stop them)."""
        self._stopped_because = why
        group, self.group = self.group, None
        if group is not None:
            group.close()

    def _dead(self) -> list[tuple[int, BaseProcess]]:
        return [(r, p) for r, p in enumerate(self.procs, start=1) if not p.is_alive()]

    def _check_alive(self) -> None:
        dead = self._dead()
        if dead:
            why = ", ".join(f"PCP rank {r} {startup.exit_reason(p.exitcode)}" for r, p in dead)
            self._leave(why)
            raise RankFailure(why)

    def _why(self, e: BaseException) -> str:
        """Why a collective failed: the ranks that died (read before close()
        forgets them), else the error, which after the collective timeout means a hung rank."""
        self._await_exits()
        dead = [f"rank {r} {startup.exit_reason(p.exitcode)}" for r, p in self._dead()]
        if dead:
            return "; ".join(dead) + f" ({startup.first_line(e)})"
        return f"{startup.first_line(e)} (a rank died, or was silent for {data_timeout_s():g} s)"

    def close(self, graceful: bool = True) -> None:
        """Stop the workers (politely unless after a failure, then by force)
        and leave the process group. Idempotent."""
        group, self.group = self.group, None
        graceful = graceful and group is not None  # without a group, the workers wait for a recovery
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
        self.store = None  # rank 0's store server (spawned ranks) goes with it
        self._server = None

    def __del__(self) -> None:
        self.close()


def _torchrun_store(env: TorchrunEnv) -> dist.Store:
    """The store torchrun's agent hosts (or rank 0 hosts, under a launcher
    without an agent store), joined as a client."""
    return open_store(env.master_addr, env.master_port, is_master=env.rank == 0 and not env.agent_store)
