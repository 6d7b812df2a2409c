"""What the engine does when a PCP rank is lost: ``RankLossHandler``, the component the
engine runs its steps through.

The step that found the loss left every request as it was (steps are all or
nothing). The executor then re-forms the group (executor/regroup.py), and
here the engine restores what the survivors lack (engine/rank_recovery.py has the
pure parts): a respawned rank's KV is copied from rank 0 (no DCP) or its
shard recomputed (DCP); without a lost rank that cannot come back, nothing is
restored (no DCP), or under DCP the cache is rebuilt for the ranks left, the
requests in flight recompute their KV and those that no longer fit fail
alone. Beyond max_rank_recoveries per window the ranks stop and the failure
is raised, as without recovery.
"""

from __future__ import annotations

import logging
import time
from typing import NoReturn

import numpy as np

from ctxpar.config import EngineConfig
from ctxpar.engine.block_manager import BlockManager
from ctxpar.engine.kv_window import KVWindow
from ctxpar.engine.rank_recovery import RankRecovery, recompute_plans
from ctxpar.engine.request import RequestGroup
from ctxpar.engine.scheduler import Scheduler
from ctxpar.errors import RankFailure, RanksStopped
from ctxpar.executor import Executor
from ctxpar.worker.step_plan import StepOutput, StepPlan

logger = logging.getLogger("ctxpar")


class CacheRebuilt(Exception):
    """A lost rank's recovery rebuilt the KV cache (DCP over fewer ranks) and preempted
    every request: the step in flight is abandoned and scheduled anew."""


def block_manager_for(config: EngineConfig, num_blocks: int, dcp_size: int, window: int | None) -> BlockManager:
    """The block manager of a KV cache sharded over ``dcp_size`` ranks: under DCP a logical
    block (the unit allocated, counted and hashed for prefix caching) is block_size * D
    tokens; each rank stores block_size of them. window: the keys every layer sees, whose
    out-of-reach blocks it frees (kv_window.freeing_window), or None."""
    kv_window = None if window is None else KVWindow(window, dcp_size, config.cp_interleave)
    return BlockManager(num_blocks, config.block_size * dcp_size, config.enable_prefix_caching, kv_window)


class RankLossHandler:
    """Runs the engine's steps on the executor and recovers from lost ranks, between the
    engine and the executor: the engine holds one and executes through it."""

    def __init__(
        self, config: EngineConfig, executor: Executor, scheduler: Scheduler, groups: dict[str, RequestGroup]
    ) -> None:
        """groups: the engine's requests in flight, by id (the engine's own dict: a rebuilt
        cache fails those that no longer fit)."""
        self.config = config
        self.executor = executor
        self.scheduler = scheduler  # whose block manager a rebuild replaces
        self.groups = groups
        self.num_blocks = executor.rank_model.num_blocks
        self.dcp_size = config.dcp_size  # fewer after a lost rank left out under DCP (_go_on)
        self.stats = RankRecovery(
            config.max_rank_recoveries,
            config.rank_recovery_window_s,
            pcp_size=config.pcp_size,
            pcp_ranks=config.pcp_size,
        )
        # When a recovery rebuilt the KV cache (_go_on): the requests that no longer fit and
        # why, for the engine to fail alone (take_unfit); None: not rebuilt.
        self._unfit: list[tuple[RequestGroup, str]] | None = None

    def take_unfit(self) -> list[tuple[RequestGroup, str]]:
        """The requests the last rebuild of the KV cache found no longer fit, and why (once)."""
        unfit, self._unfit = self._unfit or [], None
        return unfit

    def check_health(self) -> None:
        """RankFailure if a rank is lost and cannot be recovered (vLLM's check_health).
        A rank found lost while the engine is idle is recovered here, before a request needs it."""
        try:
            self.executor.check_health()
        except RankFailure as e:
            self._recover(e)

    # -- a lost rank ----------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepOutput:
        """executor.execute, recovering from lost ranks (then the step runs again; or,
        where the recovery rebuilt the KV cache, CacheRebuilt: the step is scheduled anew)."""
        while True:
            try:
                return self.executor.execute(plan)
            except RanksStopped:
                raise  # stopped for good after an earlier failure
            except RankFailure as e:
                self._recover(e)
                if self._unfit is not None:
                    raise CacheRebuilt from e

    def _recover(self, failure: RankFailure) -> None:
        """Respawn the lost rank(s) and restore the KV they held (engine/rank_recovery.py),
        or go on without them where they cannot come back; beyond max_rank_recoveries per
        window (or where neither can be done), stop the ranks and raise, as without recovery."""
        rec = self.stats
        while True:
            rec.rank_failures += 1
            if rec.max_recoveries == 0:
                self._give_up(failure, None)
            if not rec.allow():
                window = f"{rec.window_s:g} s"
                self._give_up(failure, f"{rec.max_recoveries} recoveries within {window} already (max_rank_recoveries)")
            if self.dcp_size > 1 and self.executor.rank_model.draft is not None:
                self._give_up(failure, "a draft model's KV shard is not recomputed under DCP")
            rec.recovering = True
            t0 = time.perf_counter()
            try:
                try:
                    regrouped = self.executor.recover_lost_ranks()
                except RankFailure as e:
                    self._give_up(failure, str(e))
                try:
                    what = self._restore(regrouped.respawned) if regrouped.respawned else self._go_on(regrouped.size)
                except RankFailure as e:  # another rank lost while restoring: recover again
                    failure = e
                    continue
            finally:
                rec.recovering = False
            rec.recoveries += 1
            rec.pcp_ranks = regrouped.size
            if regrouped.why_not_respawned is None:
                how = f"respawned rank(s) {', '.join(map(str, regrouped.respawned))}, {what}"
            else:
                gone = f"rank(s) {regrouped.lost} ({regrouped.why_not_respawned})"
                how = f"went on with {regrouped.size} rank(s) without {gone}, {what}"
            logger.warning("recovered from a lost PCP rank (%s): %s, in %.2f s", failure, how, time.perf_counter() - t0)
            return

    def _go_on(self, size: int) -> str:
        """After lost ranks were left out: without DCP every rank left holds the whole cache,
        so nothing is restored. Under DCP every request lost a shard placed by position
        modulo D, which ``size`` ranks cannot take over: the cache is rebuilt for D = size
        and the requests in flight recompute their KV (as preempted ones do); those whose
        context no longer fits fail alone."""
        if self.dcp_size == 1:
            return "nothing to restore: every rank left holds the whole KV cache"
        self.dcp_size = size
        held = self.scheduler.preempt_all()
        window = self.scheduler.block_manager.window
        keys = None if window is None else window.keys
        self.scheduler.block_manager = block_manager_for(self.config, self.num_blocks, size, keys)
        capacity = self.num_blocks * self.scheduler.block_manager.block_size  # the engine's max_model_len follows
        self._unfit = []
        for group in list(self.groups.values()):
            longest = max(r.max_total_tokens for r in group.samples)
            queued = any(r in self.scheduler.waiting for r in group.samples)  # not still compiling a grammar
            if longest > capacity and queued:
                why = f"no longer fits the KV cache of {capacity} tokens left on {size} rank(s)"
                self._unfit.append((group, f"its context (up to {longest} tokens) {why}"))
        return (
            f"rebuilt the KV cache for DCP over {size} rank(s) ({capacity} tokens): {len(held)} requests recompute "
            f"their KV, {len(self._unfit)} fail alone (their context no longer fits)"
        )

    def _restore(self, respawned: list[int]) -> str:
        """Restore the KV of the requests in flight on the respawned ranks; says what it did."""
        bm = self.scheduler.block_manager
        if self.dcp_size > 1 and bm.window is not None:
            # A lost shard's positions are recomputed from the keys before them, which the
            # window may have freed: the requests recompute all their KV, as preempted ones do.
            held = self.scheduler.preempt_all()
            self._unfit = []  # nothing fails alone; the step in flight is scheduled anew
            return f"{len(held)} requests recompute their KV, dropped {bm.forget_unreferenced()} cached blocks"
        dropped = bm.forget_unreferenced()  # a lost rank's part of them is gone
        held = [r for r in self.scheduler.running if r.num_computed_tokens > 0]
        table = lambda r: np.asarray(bm.block_table(r.request_id), dtype=np.int64)
        tokens = sum(r.num_computed_tokens for r in held)
        if self.dcp_size == 1:  # every rank holds the whole cache: copy rank 0's
            bs = bm.block_size
            blocks = {b for r in held for b in table(r)[: -(-r.num_computed_tokens // bs)].tolist()}
            self.executor.copy_kv(np.array(sorted(blocks), dtype=np.int64))
            self.stats.copied_tokens += tokens
            return f"copied the KV of {tokens} tokens of {len(held)} requests, dropped {dropped} cached blocks"
        recomputed = 0
        for plan in recompute_plans(
            held, table, respawned, self.dcp_size, self.config.cp_interleave, self.config.max_num_batched_tokens
        ):
            self.executor.execute(plan)
            recomputed += plan.num_tokens
        self.stats.recomputed_tokens += recomputed
        return (
            f"recomputed the lost shard ({recomputed} of {tokens} tokens of {len(held)} requests), "
            f"dropped {dropped} cached blocks"
        )

    def _give_up(self, failure: RankFailure, why: str | None) -> NoReturn:
        """Stop the ranks and raise the failure (with why it was not recovered)."""
        self.executor.close(graceful=False)
        if why is None:
            raise failure
        raise RankFailure(f"{failure}; not recovered: {why}") from failure
