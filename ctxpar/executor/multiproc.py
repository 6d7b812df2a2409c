"""Starting, driving and stopping P ranks (ctxpar/executor/__init__.py chooses this executor).

Rank 0 (the caller's process) runs the engine and its own model runner. The
other ranks are either spawned here with torch.multiprocessing, or started by
torchrun (the torch.distributed environment variables are set): then every
process runs the same program, rank 0 drives and the others serve in
``MultiRankExecutor.__init__`` until rank 0 shuts down, and then exit.

Ranks meet through the handshake of startup.py, on a store whose keys lie
under a prefix of the launch's nonce and whose values are tagged with the
launch's secret (parallel/auth.py); spawned workers receive both in their spawn
arguments, torchrun's ranks share a secret (parallel/cluster_secret.py) and
agree on a fresh nonce first (launch_nonce.py). Rank 0's messages to the
other ranks are encoded as data (worker/plan_wire.py).

The other ranks' processes (or torchrun's heartbeats) are watched and stopped
by RankProcesses (rank_processes.py); this module leads the group: steps,
recoveries, shutdown.
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np
import torch.distributed as dist

from ctxpar.config import EngineConfig
from ctxpar.device import resolve_device
from ctxpar.errors import RankFailure, RanksStopped
from ctxpar.executor import launch_nonce, rank_worker, regroup, startup
from ctxpar.executor.rank_processes import EXIT_GRACE_S, RankProcesses
from ctxpar.executor.regroup import Members, Regrouped
from ctxpar.executor.step_watch import StepWatch
from ctxpar.parallel.auth import new_nonce, new_secret, store_prefix
from ctxpar.parallel.cluster_secret import cluster_secret
from ctxpar.parallel.comm import STARTUP_TIMEOUT_S, Launch, PCPGroup, TorchrunEnv, data_timeout_s, torchrun_env
from ctxpar.parallel.rendezvous_store import host_store, open_store
from ctxpar.parallel.signed_store import SignedStore
from ctxpar.worker import plan_wire
from ctxpar.worker.loading import load_rank
from ctxpar.worker.step_plan import KVCopy, StepOutput, StepPlan

__all__ = ["MultiRankExecutor", "RankFailure", "free_port"]

# Under torchrun the agent's store outlives an LLM, and every process creates its
# LLMs in the same order: the n-th LLM of every rank agrees on its launch's nonce
# under "ctxpar/torchrun/n/" (each executor's later keys lie under its nonce).
_executor_serial = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class MultiRankExecutor:
    """Rank 0's handle on all PCP ranks: execute(plan) runs the step everywhere."""

    def __init__(self, config: EngineConfig) -> None:
        """Load rank 0's model, then start the other ranks (spawned, or met
        under torchrun, where a non-zero rank serves here and never returns).
        The caller has run preflight.check_launch."""
        self.config = config
        self.size = config.pcp_size  # ranks in the group: fewer after a rank lost for good
        self.processes = RankProcesses(config.pcp_size)
        self.group: PCPGroup | None = None
        self.store: dist.Store | None = None
        self._server: dist.TCPStore | None = None
        self._port = 0  # of rank 0's store, which respawned ranks join (spawned ranks only)
        self._generation = 0  # recoveries so far: ranks meet under regroup.generation_store
        self._signed_stores: list[SignedStore] = []  # kept alive while stores built on them are used
        self._watch: StepWatch | None = None  # over the heartbeats during steps (torchrun's rank 0)
        env = torchrun_env()
        rank = env.rank if env is not None else 0
        if env is not None:  # agreed before the model load: ranks given different secrets fail fast
            raw = _torchrun_store(env)
            self.launch = Launch(secret=cluster_secret(), spawned=False)
            self._prefix = f"ctxpar/torchrun/{next(_executor_serial)}/"  # fixed names (launch_nonce.py)
            self.launch = replace(self.launch, nonce=launch_nonce.agree(self._signed(raw), rank, env.world_size))
        else:
            self.launch = Launch(secret=new_secret(), spawned=True, nonce=new_nonce())
        self._prefix = store_prefix(self.launch.nonce)
        self.rank_model = load_rank(config, resolve_device(config.device, env.local_rank if env is not None else 0))
        if env is not None:
            self.store = self._signed(raw)
            if rank != 0:
                self._serve_torchrun_worker(env, rank)  # never returns
            self.processes.heartbeats = regroup.Heartbeats(self.store)
            # A client of the store even where rank 0 hosts it (a launcher without an agent store).
            self._watch = StepWatch(lambda: self._signed(open_store(env.master_addr, env.master_port, False)))
        else:
            # port 0: the store binds a free port itself (no race with other jobs).
            self._server = host_store(config.master_addr, config.master_port or 0)
            self._port = self._server.port
            self.store = self._signed(self._server)
        try:
            if env is None:
                self._spawn(list(range(1, config.pcp_size)))
            self._form_group(regroup.generation_store(self.store, 0), regroup.generation_keys(0), fresh=True)
        except BaseException as e:  # KeyboardInterrupt included: never leave workers behind
            startup.abandon(self.store, startup.first_line(e))
            # Read before close() forgets the processes.
            why = self.processes.why_failed(e, self.store) if isinstance(e, Exception) else ""
            self.close(graceful=False)
            if isinstance(e, RankFailure) or not isinstance(e, Exception):
                raise
            raise RankFailure(f"starting {config.pcp_size} PCP ranks failed: {why}") from e

    @property
    def procs(self) -> list[BaseProcess]:
        """The spawned ranks' processes, rank r's at index r - 1 (none under torchrun)."""
        return self.processes.procs

    def _signed(self, store: dist.Store) -> dist.Store:
        """This executor's keys on ``store``, every value tagged with the launch secret."""
        signed = SignedStore(store, self.launch.secret)
        self._signed_stores.append(signed)
        return dist.PrefixStore(self._prefix, signed)

    def _form_group(self, store: dist.Store, generation: str, fresh: bool) -> None:
        """Meet every rank under ``store``'s keys and form the group (its tags keyed
        by the launch and ``generation``); a fresh runner at start-up, rank 0's own
        runner (and KV cache) kept after a recovery."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        startup.lead(store, self.size, dict(enumerate(self.procs, start=1)), deadline)
        self.group = PCPGroup(0, self.size, self.rank_model.device, store, self.launch, generation)
        if fresh:
            self.runner = rank_worker.make_runner(self.config, self.rank_model, self.group)
            self.runner_options = self.runner.target.options
        else:
            self.runner.rejoin(self.group)

    def _spawn(self, ranks: list[int]) -> None:
        # The launch (its secret) reaches the worker through the spawn pipe, never the store.
        addr, port, prefix = self.config.master_addr, self._port, self._prefix
        self.processes.spawn(
            ranks, lambda r: (self.config, r, self.size, addr, port, prefix, self._generation, self.launch)
        )

    def _serve_torchrun_worker(self, env: TorchrunEnv, rank: int) -> None:
        """A non-zero torchrun rank: serve rank 0 (through recoveries), then leave with
        the rest of the program (or raise RankFailure if rank 0 goes away or goes on
        without this rank)."""
        assert self.store is not None  # __init__ joined the store first
        regroup.start_heartbeat(lambda: self._signed(_torchrun_store(env)), rank)
        try:
            group, runner = rank_worker.join(
                self.config, self.store, rank, self.size, self.rank_model, self.launch, regroup.generation_keys(0)
            )
        except Exception as e:
            startup.report_failure(self.store, rank, e)
            raise
        rank_worker.serve_until_stopped(self.store, runner, group, 0)
        sys.exit(0)

    # Why the ranks were stopped, once execute has stopped them; None while they run.
    _stopped_because: str | None = None

    def execute(self, plan: StepPlan) -> StepOutput:
        out = self._lead(plan, lambda _: self.runner.execute(plan))
        assert out is not None  # rank 0 always gets them
        return out

    def rank_pids(self) -> list[int | None]:
        if not self.launch.spawned:  # torchrun's ranks live on their own hosts
            return [os.getpid()] + [None] * (self.size - 1)
        return [os.getpid()] + [p.pid for p in self.procs[: self.size - 1]]

    def copy_kv(self, block_ids: np.ndarray) -> None:
        """Rank 0's KV (every model's cache) of these blocks into every other rank's:
        restores a respawned rank's cache where each rank holds the whole cache."""
        self._lead(KVCopy(block_ids), lambda msg: self.runner.copy_kv(msg.block_ids))

    def _lead(self, msg: Any, run: Callable[[Any], Any]) -> Any:
        """Send ``msg`` to every rank and run it here too."""
        if self.group is None:
            why = self._stopped_because or "they were shut down after an earlier failure"
            if self.store is None:  # closed: nothing left to recover
                raise RanksStopped(f"the PCP ranks were stopped: {why}; create a new LLM")
            raise RankFailure(f"the PCP ranks were stopped: {why}")
        self._check_alive()
        try:
            with self._watching(self.group):
                self.group.broadcast_message(plan_wire.encode(msg))
                return run(msg)
        except Exception as e:
            why = self.processes.why_failed(e, self.store)
            lost = self._watch.take_lost() if self._watch is not None else None
            if lost is not None:
                rank = self.processes.torchrun_ranks.index(lost)
                why = f"PCP rank {rank}'s heartbeat stopped: its host or its link was lost ({why})"
            self._leave(f"a rank failed during a step ({why})")
            raise RankFailure(f"a PCP rank failed during a step: {why}") from e
        except BaseException as e:
            # KeyboardInterrupt (or SystemExit) on rank 0 mid-step: the other ranks are
            # inside this step's collectives and cannot be led out of them, so stop them
            # now, and let the interrupt through.
            self._stopped_because = f"a step was interrupted ({type(e).__name__})"
            self.close(graceful=False)
            raise

    def _watching(self, group: PCPGroup) -> AbstractContextManager[object]:
        """The step watch (step_watch.py) where a lost host could leave a collective
        waiting: a gloo group of torchrun ranks not all on this host."""
        if self._watch is None or group.one_host or group.device.type != "cpu":
            return nullcontext()
        return self._watch.watching(self.processes.torchrun_ranks[1 : self.size], group.cut_links)

    def check_health(self) -> None:
        """Raise RankFailure if a rank is lost: a spawned rank's process has exited, or a
        torchrun rank's heartbeat stopped (an idle engine runs no collective that would fail)."""
        if self.group is not None:
            self._check_alive(heartbeats=True)

    def recover_lost_ranks(self) -> Regrouped:
        """After a RankFailure: find the lost ranks, respawn them (spawned ranks) or,
        where that fails or cannot be done (torchrun's ranks), go on without them,
        and form the group again with the survivors, which keep their KV caches
        (the engine decides what is left of them: Regrouped). Raises RankFailure
        for a spawned rank that hung instead of dying."""
        self._leave(self._stopped_because or "a rank was lost")
        assert self.store is not None  # not closed: close() comes after giving up
        self._generation += 1
        g, spawned = self._generation, self._port != 0
        ranks = list(range(1, self.size))
        if spawned:
            self.processes.await_exits()
        deadline = time.monotonic() + data_timeout_s() + EXIT_GRACE_S  # survivors' collectives fail by then
        lost = regroup.find_lost(self.store, g, ranks, self.processes.is_dead, deadline)
        hung = [r for r in lost if spawned and self.procs[r - 1].is_alive()]
        if hung:
            raise RankFailure(f"PCP rank(s) {hung} hung instead of dying: a hung rank is not replaced")
        why_not = "ranks under torchrun are started by torchrun, not by ctxpar"
        if spawned or not lost:
            try:
                self._respawn(lost, g)
            except RankFailure as e:
                why_not = f"respawning failed: {e}"
            else:
                self._regroup(Members(list(range(self.size)), regroup.generation_keys(g)))
                return Regrouped(lost=lost, respawned=lost, size=self.size, why_not_respawned=None)
        self._regroup(Members([0, *(r for r in ranks if r not in lost)], f"{regroup.generation_keys(g)}without/"))
        return Regrouped(lost=lost, respawned=[], size=self.size, why_not_respawned=why_not)

    def _respawn(self, lost: list[int], generation: int) -> None:
        """Spawn the lost ranks again and wait until they have loaded the model (the
        survivors are told to meet only once they have). RankFailure if one fails."""
        assert self.store is not None
        self._spawn(lost)
        store = regroup.generation_store(self.store, generation)
        try:
            startup.await_ready(store, lost, {r: self.procs[r - 1] for r in lost}, time.monotonic() + STARTUP_TIMEOUT_S)
        except RankFailure:
            self.processes.kill(lost)
            raise

    def _regroup(self, members: Members) -> None:
        """Tell the survivors who is in the group now, and form it (old rank
        members.ranks[i] becomes rank i)."""
        assert self.store is not None
        regroup.announce(self.store, self._generation, members)
        self.processes.keep(members.ranks)
        self.size = len(members.ranks)
        keys = dist.PrefixStore(members.keys, self.store)
        try:
            self._form_group(keys, members.keys, fresh=False)
        except Exception as e:
            startup.abandon(keys, startup.first_line(e))  # the survivors waiting for the verdict leave
            why = self.processes.why_failed(e, self.store)
            self._leave(f"recovering from a lost rank failed ({why})")
            raise RankFailure(f"re-forming the PCP group of ranks {members.ranks} failed: {why}") from e
        self._stopped_because = None

    def _check_alive(self, heartbeats: bool = False) -> None:
        """heartbeats: read torchrun ranks' heartbeats too (see RankProcesses.lost)."""
        why = self.processes.lost(self.size, heartbeats)
        if why:
            self._leave(why)
            raise RankFailure(why)

    def _leave(self, why: str) -> None:
        """Leave the broken group, keeping the surviving ranks (they wait for a
        recovery, or for close() to stop them)."""
        self._stopped_because = why
        group, self.group = self.group, None
        if group is not None:
            group.close()

    def close(self, graceful: bool = True) -> None:
        """Stop the workers (politely unless after a failure, then by force)
        and leave the process group. Idempotent."""
        group, self.group = self.group, None
        graceful = graceful and group is not None  # without a group, the workers wait for a recovery
        if group is None:  # torchrun's ranks waiting for a recovery: none is coming
            regroup.abandon(self.store, self._generation + 1, self._stopped_because or "rank 0 shut down")
        if graceful and group is not None and not self.processes.dead():
            try:
                group.broadcast_message(plan_wire.encode(None))
            except Exception:
                pass  # a broken group: the workers are terminated below
        self.processes.stop(graceful)
        if group is not None:
            group.close()
        if self._watch is not None:
            self._watch.close()
        self.store = None  # rank 0's store server (spawned ranks) goes with it
        self._server = None
        self._signed_stores = []

    def __del__(self) -> None:
        self.close()


def _torchrun_store(env: TorchrunEnv) -> dist.Store:
    """The store torchrun's agent hosts (or rank 0 hosts, under a launcher
    without an agent store), joined as a client."""
    return open_store(env.master_addr, env.master_port, is_master=env.rank == 0 and not env.agent_store)
