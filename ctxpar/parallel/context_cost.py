"""Predicted time of the two ways split prefill rows reach a context sharded by
DCP (ctxpar/layers/sharded_context.py): gathering it, or passing their queries.

Per layer, with C the bytes of the rows' whole context (every shard), c the
part of it on the other ranks ((P-1)/P·C), q and p the queries and partial
outputs each rank receives from the others, alpha the latency of one collective
step, B the link's rate and M the memory's:

- gather: ``rounds`` all-gathers of at most the workspace's positions, each
  P-1 ring steps: rounds·(P-1)·alpha + c/B; each round is copied into position
  order (read and written) and attention reads the whole context: 3·C/M;
- pass-Q: the queries ride in the step's KV all-gather (no step of their own):
  q/B; the partials take one all-to-all and are merged (P of them read, one
  written): alpha + p/B + (P+1)/(P-1)·p/M, neither when a replicated row
  exchanges partials anyway (p = 0); attention reads only the rank's shard: C/(P·M).

Attention's FLOPs are the same either way (every rank attends n queries over
the whole context, or all P·n over 1/P of it), so they do not enter the choice.
Pure Python: the engine derives a ``ContextCost`` from the hardware profile at
start-up (ctxpar/costmodel/policy.py) and every rank compares the same numbers;
the policy makes the same choice (``gathers``) when it prices a step's groups of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ctxpar.errors import CtxparError

# Without a cost model: gather the context when the bytes it moves are below this times
# the bytes pass-Q would move (its queries, and its partials unless some replicated row
# exchanges partials anyway). Timed alone on two gloo ranks, the paths broke even at a
# bytes ratio of 0.8 and 1.0 in two runs: ctxpar bench dcp, part (e), docs/benchmarks.md.
GATHER_COST_RATIO = 1.0
WORKSPACE_TOKENS = 2048  # context positions gathered per round (the engine passes max_num_batched_tokens)


@dataclass(frozen=True)
class ContextCost:
    """The rates the gather/pass-Q choice is timed with (the hardware profile's,
    efficiencies applied)."""

    latency_s: float  # one collective step between the DCP ranks (alpha)
    link_bytes_per_s: float  # what one rank receives per second over the link
    memory_bytes_per_s: float  # what one rank reads or writes per second in memory

    def __post_init__(self) -> None:
        if not self.latency_s >= 0 or not self.link_bytes_per_s > 0 or not self.memory_bytes_per_s > 0:
            raise CtxparError(f"context cost needs latency >= 0 and rates > 0, got {self}")

    def gather_s(self, ranks: int, rounds: int, context: float, stored: float) -> float:
        """Seconds to gather ``stored`` bytes of context (``context`` of them from the
        other ranks) in ``rounds`` all-gathers, put them in order and read them."""
        link = rounds * (ranks - 1) * self.latency_s + context / self.link_bytes_per_s
        return link + 3 * stored / self.memory_bytes_per_s

    def pass_q_s(self, ranks: int, queries: float, partials: float, stored: float) -> float:
        """Seconds to receive ``queries`` and ``partials`` bytes from the other ranks, merge
        the partials (none: exchanged anyway) and read this rank's shard of ``stored``."""
        exchange = 0.0
        if partials > 0:
            merge = (ranks + 1) / (ranks - 1) * partials / self.memory_bytes_per_s
            exchange = self.latency_s + partials / self.link_bytes_per_s + merge
        return queries / self.link_bytes_per_s + exchange + stored / ranks / self.memory_bytes_per_s

    def describe(self) -> str:
        return (
            f"link {self.latency_s * 1e6:.0f} us + {self.link_bytes_per_s / 1e9:.3g} GB/s a step, "
            f"memory {self.memory_bytes_per_s / 1e9:.3g} GB/s"
        )


@dataclass(frozen=True)
class MovedBytes:
    """Bytes each rank receives to reach the split rows' context, by path; ``stored``:
    the context's own bytes on all the shards (what the paths read in memory)."""

    context: float  # gather: the other ranks' shards of the contexts
    queries: float  # pass-Q: the other ranks' queries
    partials: float  # pass-Q: their partial outputs and LSEs (0: exchanged anyway)
    stored: float

    @property
    def pass_q(self) -> float:
        return self.queries + self.partials


def moved_bytes(
    context_tokens: int,
    n: int,
    heads: int,
    query_bytes: float,
    entry_bytes: float,
    out_dim: int,
    ranks: int,
    exchange_anyway: bool,
) -> MovedBytes:
    """What each path moves, for ``n`` query tokens on each rank of ``heads`` heads,
    ``query_bytes`` a token, and a context of ``entry_bytes`` a token:

    - gather: the other ranks' shards of the contexts, (P-1)/P·C·E;
    - pass-Q: the other ranks' queries, (P-1)·n·query_bytes, and their partials,
      (P-1)·n·H·(Dv+1) floats (not counted when ``exchange_anyway``: a
      replicated row with context exchanges partials whatever the split rows do).
    """
    others = ranks - 1
    partials = 0 if exchange_anyway else others * n * heads * (out_dim + 1) * 4
    stored = context_tokens * entry_bytes
    return MovedBytes(others / ranks * stored, others * n * query_bytes, partials, stored)


def gathers(
    moved: MovedBytes, context_tokens: int, ranks: int, workspace_tokens: int, cost: ContextCost | None, ratio: float
) -> bool:
    """Whether split rows with ``context_tokens`` of cached context gather it (else
    pass-Q): the path ``cost`` predicts faster, or without one, gather when its bytes
    are below ``ratio`` times pass-Q's."""
    if cost is None:
        return moved.context < ratio * moved.pass_q
    rounds = -(-context_tokens // workspace_tokens)  # plan_rounds packs the rows' contexts end to end
    gather = cost.gather_s(ranks, rounds, moved.context, moved.stored)
    return gather < cost.pass_q_s(ranks, moved.queries, moved.partials, moved.stored)
