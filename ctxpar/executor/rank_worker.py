"""A PCP rank other than rank 0: join the group, run what rank 0 sends, and
rejoin a re-formed group after a lost rank (regroup.py).

Spawned ranks enter at ``worker_main``; ranks under torchrun serve inside
MultiRankExecutor.__init__ through ``serve_until_stopped``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from ctxpar.config import EngineConfig
from ctxpar.device import resolve_device
from ctxpar.errors import RankFailure
from ctxpar.executor import regroup, startup
from ctxpar.executor.shared_weights import share_weights
from ctxpar.layers.weight_arena import place_on_huge_pages
from ctxpar.parallel.auth import Unauthenticated
from ctxpar.parallel.comm import STARTUP_TIMEOUT_S, Launch, PCPGroup
from ctxpar.parallel.rendezvous_store import open_store
from ctxpar.parallel.shm_channel import PeerLost
from ctxpar.parallel.signed_store import SignedStore
from ctxpar.worker import plan_wire
from ctxpar.worker.loading import RankModel, load_rank
from ctxpar.worker.model_runner import ModelRunner
from ctxpar.worker.options import RunnerOptions
from ctxpar.worker.plan_wire import MalformedMessage
from ctxpar.worker.runners import Runners
from ctxpar.worker.step_plan import KVCopy, StepPlan


def make_runner(config: EngineConfig, rank_model: RankModel, group: PCPGroup, share: bool = True) -> Runners:
    """share: map the host's one copy of the weights (every rank at start-up; a rank
    respawned after a failure keeps its own copy, the others having shared theirs)."""
    options = RunnerOptions.from_config(
        config, rank_model.num_blocks, rank_model.loaded.hf_config, one_host=group.one_host
    )

    def make(model: Any, is_draft: bool) -> ModelRunner:  # model: a loaded CausalLM module
        # One copy per host instead of one per rank; else this rank's own, in huge pages.
        shared = group.one_host and share and share_weights(model, group, "draft_weights" if is_draft else "weights")
        if not shared and not is_draft:
            place_on_huge_pages(model)
        return ModelRunner(model, options, group.device, group)

    return Runners.build(rank_model, make)


def join(
    config: EngineConfig,
    store: dist.Store,
    rank: int,
    size: int,
    rank_model: RankModel,
    launch: Launch,
    generation: str,
    share: bool = True,
) -> tuple[PCPGroup, Runners]:
    """A worker with its model loaded: handshake, then (group, runner); share: see make_runner."""
    group = meet(store, rank, size, rank_model.device, launch, generation)
    return group, make_runner(config, rank_model, group, share)


def meet(store: dist.Store, rank: int, size: int, device: torch.device, launch: Launch, generation: str) -> PCPGroup:
    """Handshake under ``store``'s keys (startup.follow), then form the group of
    ``generation`` (regroup.generation_keys): at start-up, and again each time rank 0
    re-forms it after a lost rank."""
    startup.follow(store, rank, time.monotonic() + STARTUP_TIMEOUT_S)
    return PCPGroup(rank, size, device, store, launch, generation)


def next_message(group: PCPGroup) -> StepPlan | KVCopy | None:
    """Rank 0's next message, once its tag checks (auth.Unauthenticated if it does not)
    and it decodes as data (plan_wire.MalformedMessage if it does not)."""
    return plan_wire.decode(group.broadcast_message())


def serve(runner: Runners, group: PCPGroup) -> None:
    """Run every message rank 0 sends (step plans, KV copies), until it sends None.

    Raises RankFailure when a link fails: rank 0 or a peer went away (its
    sockets close, or its process is seen dead), or rank 0 left the group to
    recover from a lost rank; the wait for the next plan, or a collective of
    the step under way, then fails at once.
    """
    while True:
        try:
            msg = next_message(group)
            if msg is None:
                return
            if isinstance(msg, KVCopy):
                runner.copy_kv(msg.block_ids)
            else:
                runner.execute(msg)
        except Exception as e:
            if not is_link_failure(e):
                raise  # this rank's own failure: the caller shows the traceback
            raise RankFailure(f"PCP rank {group.rank} lost rank 0 or a peer ({startup.first_line(e)})") from e


def serve_until_stopped(store: dist.Store, runner: Runners, group: PCPGroup, generation: int) -> None:
    """A worker's life: serve; when the group breaks, check in and wait for rank 0
    to re-form it (a lost rank respawned, or left out), and serve on in it, keeping
    this rank's KV cache. Raises RankFailure when rank 0 is gone, gives up, or
    left this rank out."""
    while True:
        try:
            serve(runner, group)
            group.close()
            return
        except RankFailure as failure:
            group.close()
            generation += 1
            regroup.check_in(store, generation, group.rank)
            members = regroup.await_recovery(store, generation, group.rank, failure)
            rank = members.new_rank(group.rank)
            if rank is None:
                raise RankFailure(f"{failure}; rank 0 found PCP rank {group.rank} lost and went on without it")
            keys = dist.PrefixStore(members.keys, store)
            group = meet(keys, rank, len(members.ranks), group.device, group.launch, members.keys)
            runner.rejoin(group)


def report_refusal(store: dist.Store, e: Exception) -> None:
    """Tell rank 0 why this rank leaves, under its pid (rank 0 knows its workers by
    process; their numbers change when a group re-forms). Best effort."""
    try:
        store.set(f"refused/{os.getpid()}", str(e))
    except Exception:
        pass  # the store is gone: rank 0 still sees the exit


def refusal(store: dist.Store | None, pid: int | None) -> str | None:
    """Why the worker of process ``pid`` refused a message and left, if it said so."""
    key = f"refused/{pid}"
    try:
        return store.get(key).decode() if store is not None and store.check([key]) else None
    except Exception:
        return None  # the reason itself failed its check, or the store is gone: the exit says enough


def is_link_failure(e: Exception) -> bool:
    # gloo's transport errors surface as plain RuntimeErrors naming the transport.
    return isinstance(e, (dist.DistError, PeerLost)) or "gloo/transport" in str(e)


def worker_main(
    config: EngineConfig, rank: int, size: int, addr: str, port: int, prefix: str, generation: int, launch: Launch
) -> None:
    """Entry point of a spawned rank of a group of ``size``. generation: 0 at start-up; g
    for a rank respawned by rank 0's g-th recovery (it meets the others under that
    generation's keys). launch: the launch's secret, given here rather than on the store."""
    # Started with SIGINT blocked (see RankProcesses.spawn): ignore it, then unblock.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    store = gstore = None
    try:
        signed = SignedStore(open_store(addr, port, is_master=False), launch.secret)  # kept for the rank's life
        store = dist.PrefixStore(prefix, signed)
        gstore = regroup.generation_store(store, generation)
        gstore.set(f"started/{rank}", "")
        rank_model = load_rank(config, resolve_device(config.device, rank))
        group, runner = join(
            config, gstore, rank, size, rank_model, launch, regroup.generation_keys(generation), share=generation == 0
        )
    except Exception as e:
        startup.report_failure(gstore, rank, e)
        if not isinstance(e, (RankFailure, Unauthenticated)):  # rank 0 tells the user why
            print(f"ctxpar: PCP rank {rank} failed to start:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(1)
    try:
        serve_until_stopped(store, runner, group, generation)
    except RankFailure as e:  # rank 0 is gone, or went on without this rank
        print(f"ctxpar: {e}; exiting", file=sys.stderr, flush=True)
        sys.exit(1)
    except (Unauthenticated, MalformedMessage) as e:  # refused (forged, or not data): this rank leaves, not guesses
        report_refusal(store, e)
        print(f"ctxpar: PCP rank {rank}: {e}; exiting", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception:
        print(f"ctxpar: PCP rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(1)
