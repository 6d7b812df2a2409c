"""The engine's PCP policy, from the cost model: when a prompt is split, when
rows that are not split are spread, and over which ranks each split prompt goes.

At start-up (``derive_policy``), for the model's shapes, P, D and a hardware
profile, two thresholds, derived rather than fixed constants:

- ``min_tokens``: the fewest new tokens for which splitting a prompt over P
  ranks is predicted faster than computing it on one (timing.prefill_time);
- ``spread_min_rows``: the fewest decode rows for which giving each to one
  rank (1/P of the rows each, plus a KV all-gather per layer and the sampled
  states' gather) is predicted faster than every rank computing all of them.

A value the user set wins. Per step (``PCPPolicy.split_ranks``), the split rows'
groups of ranks (ctxpar/parallel/pcp_groups.py): in mode "auto", of "all",
"disjoint" and "whole", the one with the least predicted time of the slowest
rank (ties keep "all"; under DCP every rank attends every query over its
shard, so there the groups move only the linear layers' work);
the other modes force one. Every input is the plan's
(rank-invariant) and the arithmetic deterministic, so every rank picks the same.

Pure Python and numpy: no torch, no torch.distributed.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ctxpar.config import PCP_SPLIT_MODES
from ctxpar.costmodel.hardware import HardwareProfile
from ctxpar.costmodel.shapes import ModelShape
from ctxpar.costmodel.timing import decode_time, prefill_time
from ctxpar.errors import CtxparError
from ctxpar.parallel.pcp import plan_pcp_layout
from ctxpar.parallel.pcp_groups import SPLIT_MODES, split_groups

NEVER = sys.maxsize  # a threshold no step reaches
MAX_TOKENS = 1 << 22  # search bound: a prompt this long that does not pay to split never will
MAX_ROWS = 1 << 16
# Context of the decode rows spread_min_rows is sized for: unknown at start-up; longer
# contexts make spreading pay sooner (each rank reads 1/P of the rows' KV instead of all).
DECODE_CONTEXT = 1024


@dataclass(frozen=True)
class PCPPolicy:
    model: ModelShape
    hardware: HardwareProfile
    pcp_size: int
    dcp_size: int
    min_tokens: int  # prefill rows shorter than this are not split
    spread_min_rows: int  # unsplit rows are spread in steps of at least this many (or beside a split row)
    split_mode: str  # "auto" (per step, from the model), "all", "disjoint" or "whole"
    derived: tuple[str, ...] = ()  # which of min_tokens, spread_min_rows came from the model

    def describe(self) -> str:
        def show(name: str, value: int) -> str:
            how = "from the cost model" if name in self.derived else "set"
            how = "DCP: decodes on every rank" if name == "pcp_spread_min_rows" and self.dcp_size > 1 else how
            return f"{name}={'never' if value == NEVER else value} ({how})"

        return (
            f"PCP policy ({self.hardware.name}, P={self.pcp_size}, D={self.dcp_size}): "
            f"{show('pcp_min_tokens', self.min_tokens)}, {show('pcp_spread_min_rows', self.spread_min_rows)}, "
            f"split prompts over: {self.split_mode}"
        )

    def split_ranks(
        self, num_tokens: np.ndarray, num_computed: np.ndarray, is_split: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(first, width), each (R,): the group of ranks of each split row of a step
        (plan_pcp_layout's ``split_ranks``); None: every split row over all ranks."""
        rows = np.flatnonzero(is_split)
        auto = self.split_mode == "auto"
        if self.pcp_size == 1 or self.split_mode == "all" or len(rows) < (2 if auto else 1):
            return None
        q, c = num_tokens[rows].astype(np.int64), num_computed[rows].astype(np.int64)
        work = self._row_seconds(q, c)
        if auto:
            modes = [m for m in SPLIT_MODES if m != "whole" or len(rows) < self.pcp_size]  # else == disjoint
            options = [split_groups(m, work, self.pcp_size) for m in modes]
            first, width = min(options, key=lambda g: self._step_seconds(q, c, g))  # first minimum: "all" on ties
        else:
            first, width = split_groups(self.split_mode, work, self.pcp_size)
        if (width == self.pcp_size).all():
            return None
        R = len(num_tokens)
        out_first, out_width = np.zeros(R, dtype=np.int64), np.full(R, self.pcp_size, dtype=np.int64)
        out_first[rows], out_width[rows] = first, width
        return out_first, out_width

    def _row_seconds(self, q: np.ndarray, c: np.ndarray) -> np.ndarray:
        """(S,) compute seconds of each row on one rank: what the groups balance."""
        m, h = self.model, self.hardware
        pairs = q * c + q * (q + 1) / 2
        return 2 * m.linear_params_per_token * q / _gemm(h) + pairs * m.attention_flops_per_pair * m.num_layers / _attn(
            h
        )

    def _step_seconds(self, q: np.ndarray, c: np.ndarray, groups: tuple[np.ndarray, np.ndarray]) -> float:
        """Predicted seconds of the slowest rank for the split rows laid out over ``groups``:
        its linear layers (weights read once) and its rows' attention, each the slower
        of compute and memory traffic (a row reads the keys of its whole context), and a
        fixed cost per row and layer. The KV all-gather moves the same tokens whatever
        the groups, so it does not enter the choice; nor, under DCP, do the queries that
        travel with it and the partials' all-to-all.

        Under DCP every rank attends every query of the step over its own 1/P of the
        keys (ctxpar/layers/attention/sharded.py), whatever the groups: the attention
        work is even, and only the linear layers follow the groups."""
        m, h, P = self.model, self.hardware, self.pcp_size
        layout = plan_pcp_layout(q, c, np.ones(len(q), dtype=bool), P, split_ranks=groups)
        tokens, pairs = layout.per_rank_num_tokens, layout.attention_work().astype(np.float64)
        ends = layout.row_start_pos + layout.row_num_tokens  # (rows,) keys each row reads
        rows = np.diff(layout.rank_row_start)  # (P,) row pieces on each rank
        keys = np.bincount(np.repeat(np.arange(P), rows), weights=ends, minlength=P)  # (P,) over each rank's pieces
        if self.dcp_size > 1:
            pairs = np.full(P, float((q * c + q * (q + 1) / 2).sum()) / P)
            keys = np.full(P, float((c + q).sum()) / P)
        linear = np.maximum(
            2 * m.linear_params_per_token * tokens / _gemm(h), m.dense_params * h.weight_bytes / h.weight_read_rate
        )
        attention = np.maximum(
            pairs * m.attention_flops_per_pair * m.num_layers / _attn(h),
            keys * h.kv_token_bytes(m) * m.num_layers / h.memory_rate,
        )
        return float((linear + attention + rows * m.num_layers * h.row_overhead_s).max())


def _gemm(h: HardwareProfile) -> float:
    return h.gemm_flops * h.gemm_efficiency


def _attn(h: HardwareProfile) -> float:
    return h.attention_flops * h.attention_efficiency


def _first(pays: Callable[[int], bool], hi: int) -> int:
    """Least n in [1, hi] with pays(n), for a pays that stays True once True; NEVER if none."""
    if not pays(hi):
        return NEVER
    lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if pays(mid) else (mid + 1, hi)
    return lo


def split_min_tokens(m: ModelShape, h: HardwareProfile, pcp: int, dcp: int) -> int:
    """Fewest new tokens (no cached prefix) for which a prompt split over ``pcp`` ranks
    is predicted faster than on one rank; 0 for one rank (nothing to split over)."""
    if pcp == 1:
        return 0

    def pays(q: int) -> bool:
        split = prefill_time(m, h, q, 0, 1, pcp, dcp, "gather").total_s
        return split < prefill_time(m, h, q, 0, 1, 1, 1, "gather").total_s

    return _first(pays, MAX_TOKENS)


def spread_rows(m: ModelShape, h: HardwareProfile, pcp: int, context: int = DECODE_CONTEXT) -> int:
    """Fewest decode rows (each at ``context`` tokens) for which giving each to one of
    ``pcp`` ranks is predicted faster than every rank computing them all."""
    if pcp == 1:
        return NEVER
    kv_token = h.kv_token_bytes(m)

    def pays(n: int) -> bool:
        mine = math.ceil(n / pcp)  # each rank's rows, padded to the most any rank has
        gather_kv = m.num_layers * h.link_time((pcp - 1) * mine * kv_token, steps=pcp - 1)
        to_rank0 = h.link_time((pcp - 1) * mine * m.hidden_size * h.act_bytes)
        spread = decode_time(m, h, context, mine, 1).total_s + gather_kv + to_rank0
        return spread < decode_time(m, h, context, n, 1).total_s

    return _first(pays, MAX_ROWS)


def derive_policy(
    model: ModelShape,
    hardware: HardwareProfile,
    pcp_size: int,
    dcp_size: int,
    min_tokens: int | None = None,
    spread_min_rows: int | None = None,
    split_mode: str = "auto",
) -> PCPPolicy:
    """The policy for these shapes and this hardware; a threshold given (not None) is kept."""
    if split_mode not in PCP_SPLIT_MODES:
        raise CtxparError(f"pcp_split_mode must be one of {', '.join(PCP_SPLIT_MODES)}, got {split_mode!r}")
    if dcp_size > 1:
        spread_min_rows = NEVER  # a decode's queries must be on every rank (each attends its own shard)
    given = (("pcp_min_tokens", min_tokens), ("pcp_spread_min_rows", spread_min_rows))
    derived = tuple(name for name, value in given if value is None)
    return PCPPolicy(
        model=model,
        hardware=hardware,
        pcp_size=pcp_size,
        dcp_size=dcp_size,
        min_tokens=split_min_tokens(model, hardware, pcp_size, dcp_size) if min_tokens is None else min_tokens,
        spread_min_rows=spread_rows(model, hardware, pcp_size) if spread_min_rows is None else spread_min_rows,
        split_mode=split_mode,
        derived=derived,
    )
