"""Surviving a lost rank: how often it may happen, and what must be restored.

When a spawned rank dies, the executor respawns it and forms the group again
with the survivors (ctxpar/executor/regroup.py). The survivors keep their KV
caches; the respawned rank's is empty. What the engine then restores for
every request that has KV (``num_computed_tokens > 0``):

- without DCP every rank holds the whole cache: the respawned rank gets a
  copy of rank 0's blocks; nothing is recomputed;
- under DCP the lost rank held its shard of every request (positions t with
  ``(t // I) % D`` = the lost rank) and nobody else has it: those positions
  are recomputed from the request's tokens, as rows of a step, with the
  surviving shards as their context.

A lost position's KV at layer l depends on the hidden state there, which
depends (through attention) on every earlier position's KV at the layers
below. A step computes layer by layer, writing every row's new KV before
any row attends, so one step whose rows are the runs of lost positions,
each row ``[s, s + n)`` with context ``[0, s)``, recomputes them exactly:
the earlier lost runs of the same request are written at each layer before
the later runs attend to them. Steps split the runs in position order, so
a later step finds the earlier runs in the cache.

Prefix-cache blocks that no request holds are forgotten: a lost rank's part
of them is gone, and a hit must never serve it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ctxpar.engine.request import Request
from ctxpar.worker.step_plan import StepPlan

# Positions of context a recompute step's rows may attend to in all (each row gathers
# its context's slots): what bounds a step of many one-token rows at long contexts.
MAX_CONTEXT_PER_STEP = 1 << 22


@dataclass
class RankRecovery:
    """The policy (at most ``max_recoveries`` per ``window_s``) and the counts /metrics shows."""

    max_recoveries: int
    window_s: float
    rank_failures: int = 0  # ranks found lost, recovered or not
    recoveries: int = 0
    recomputed_tokens: int = 0  # KV positions recomputed (DCP: the lost shards)
    copied_tokens: int = 0  # KV positions copied from rank 0 (without DCP)
    recovering: bool = False  # while a recovery runs (/health says "recovering")
    pcp_size: int = 1  # PCP ranks configured
    pcp_ranks: int = 1  # PCP ranks serving now: fewer after one was lost for good (/health says "degraded")
    _times: deque[float] = field(default_factory=deque)

    def allow(self, now: float | None = None) -> bool:
        """Whether one more recovery fits the window; if so, it is counted."""
        now = time.monotonic() if now is None else now
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_recoveries:
            return False
        self._times.append(now)
        return True


def lost_runs(num_computed: int, lost: Sequence[int], dcp_size: int, interleave: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the runs of positions [0, num_computed) whose KV the
    ``lost`` DCP ranks stored, in position order."""
    pos = np.arange(num_computed)
    on_lost = np.isin((pos // interleave) % dcp_size, lost).astype(np.int8)  # (num_computed,)
    edges = np.diff(np.concatenate(([0], on_lost, [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return starts, ends - starts


def recompute_plans(
    requests: Sequence[Request],
    block_table: Callable[[Request], np.ndarray],
    lost: Sequence[int],
    dcp_size: int,
    interleave: int,
    max_tokens: int,
) -> Iterator[StepPlan]:
    """Steps that recompute the lost shards of the requests' computed KV (no logits):
    rows of at most ``max_tokens`` tokens a step, each request's runs in position order."""
    rows: list[tuple[Request, int, int]] = []
    tokens = context = 0
    for req in requests:
        starts, lengths = lost_runs(req.num_computed_tokens, lost, dcp_size, interleave)
        for s, n in zip(starts.tolist(), lengths.tolist()):
            while n > 0:
                if rows and (tokens == max_tokens or context + s > MAX_CONTEXT_PER_STEP):
                    yield _plan(rows, block_table)
                    rows, tokens, context = [], 0, 0
                take = min(n, max_tokens - tokens)
                rows.append((req, s, take))
                tokens, context = tokens + take, context + s
                s, n = s + take, n - take
    if rows:
        yield _plan(rows, block_table)


def _plan(rows: list[tuple[Request, int, int]], block_table: Callable[[Request], np.ndarray]) -> StepPlan:
    ids = [t for req, s, n in rows for t in req.token_ids(s, s + n)]
    return StepPlan(
        input_ids=np.asarray(ids, dtype=np.int64),
        num_scheduled_tokens=np.array([n for _, _, n in rows], dtype=np.int64),
        num_computed_tokens=np.array([s for _, s, _ in rows], dtype=np.int64),
        is_prefilling=np.ones(len(rows), dtype=bool),
        num_prompt_tokens=np.array([req.num_prompt_tokens for req, _, _ in rows], dtype=np.int64),
        needs_logits=np.zeros(len(rows), dtype=bool),
        block_tables=[block_table(req) for req, _, _ in rows],
    )
